"""LoRA adapter streams: the set of adapter versions resident in a server (``resident``), the adapter follower,
and adapter replay. The resolver plugin vLLM loads in every process stays at ``ckptstream.lora_aliases``: a plugin
must be cheap to import, and this package's face imports the follower (and torch)."""
