"""Following a weights stream: the follower that keeps servers on the newest good version, the host cache of
decoded versions it shares, the node agent of an engine spanning nodes, the takeover and gate that keep other
processes out of an update, and replay (evaluating old versions on the same servers)."""
