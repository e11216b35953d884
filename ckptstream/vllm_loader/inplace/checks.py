"""Whether a change staged on every rank of an engine can be applied: what the ranks' staging results
(``apply.InPlaceApplier.staged``) say together — every changed position written by some rank, and the ranks'
checks of a change without old values adding up to the publisher's (FORMAT.md "Change checks"). Used by the
follower and the weight-transfer engine, which hold the results of every rank; no torch needed."""

from __future__ import annotations

import collections
from typing import Any

from ...format import CHECK_MASK, ChangeCheck


def staging_problem(results: list[dict[str, Any]]) -> tuple[str, str] | None:
    """Whether a change staged on every rank of an engine (``InPlaceApplier.staged``, one result per rank)
    can be applied: None, or (the fallback reason of ``observe.FALLBACK_REASONS``, what went wrong). Every
    changed position of a tensor the model loads must be written by some rank (a rank writes its TP slice;
    the slices add up): a loader that returned without copying would leave it stale. A change whose old
    values the ranks read themselves (``xor-1``) must pass its checks (``check_problem``)."""
    errors = [str(r["error"]) for r in results if r.get("error")]
    if errors:
        return "apply_failed", f"staging failed on a rank: {errors[0]}"
    unpatchable = {name: why for r in results for name, why in (r.get("unpatchable") or {}).items()}
    covered: collections.Counter[str] = collections.Counter()
    changed: dict[str, int] = {}
    for r in results:
        for name, (written, positions) in (r.get("coverage") or {}).items():
            covered[name] += written
            changed[name] = positions
    unpatchable.update({name: f"{positions - covered[name]} of its {positions} changed positions are written by "
                              f"no rank's loader" for name, positions in changed.items()
                        if covered[name] < positions and name not in unpatchable})
    if unpatchable:
        name, why = next(iter(sorted(unpatchable.items())))
        return "unpatchable", f"{len(unpatchable)} changed tensor(s) cannot be written in place, e.g. {name}: {why}"
    return check_problem(results)


def check_problem(results: list[dict[str, Any]]) -> tuple[str, str] | None:
    """Whether the ranks' checks of a change of layout ``xor-1`` (``staged``'s ``checks``) prove that they
    serve its base and will serve the version after it: None, or (``check_failed``: the values differ, or the
    ranks read different changes; ``unverifiable``: the ranks do not hold every changed position equally
    often, or a rank holds a tensor in a dtype that cannot hold the checkpoint's values, so its checkpoint
    bits are not there to check (a change with old values, ``packed-1``, can be applied there); what went
    wrong).

    Per changed tensor, the ranks together hold each of its changed positions the same number of times *r*
    (a TP split: once; a replicated norm: once per rank; kv heads replicated over ranks: twice, ...), which
    their counts and their sums of the positions' mix show (*r* times the tensor's); then their checks' sums
    must be *r* times the publisher's check (mod 2^64). A change without checks (``packed-1``) passes."""
    expected: dict[str, tuple[ChangeCheck, int]] = {}
    held: dict[str, list[tuple[ChangeCheck, int]]] = collections.defaultdict(list)
    for r in results:
        for name, check in (r.get("checks") or {}).items():
            want = ChangeCheck.from_json(check["expected"]), int(check["positions"], 16)
            if expected.setdefault(name, want) != want:  # e.g. a node's change file stale or of another stream
                return "check_failed", (f"{name}: the ranks read different changes of it (their checks or "
                                        "positions differ)")
            part = ChangeCheck.from_json(check["held"])
            if part.count:
                held[name].append((part, int(check["held_positions"], 16)))
    if expected and any(r.get("coverage") and r.get("checks") is None for r in results):
        return "unverifiable", "some ranks staged the change without checks"
    rounded = {name: why for r in results for name, why in (r.get("unverifiable") or {}).items()}
    if rounded:
        name, why = next(iter(sorted(rounded.items())))
        return "unverifiable", (f"{len(rounded)} changed tensor(s) cannot be checked from the deltas alone, e.g. "
                                f"{name}: {why}")
    for name, (want, positions) in sorted(expected.items()):
        parts = held[name]
        if not parts:
            continue  # loaded by no rank: the coverage rule decides
        times, rest = divmod(sum(p.count for p, _ in parts), want.count)
        if rest or sum(h for _, h in parts) & CHECK_MASK != times * positions & CHECK_MASK:
            return "unverifiable", (f"{name}: ranks hold {[p.count for p, _ in parts]} of its {want.count} changed "
                                    "elements, not each of them equally often")
        total = sum((p for p, _ in parts), ChangeCheck())
        if (total.old, total.new) != (times * want.old & CHECK_MASK, times * want.new & CHECK_MASK):
            return "check_failed", (f"{name}: the {len(parts)} ranks holding its {want.count} changed elements "
                                    f"({times} time(s) each) hold other values than the delta's base or result")
    return None
