"""Adapter streams on the reader's side (FORMAT.md, "Adapter streams"): the stream kind's refusal, and the
checks a follower or ``materialize`` makes before a version of a LoRA adapter is served: that it fits the
server (base model, ``--max-lora-rank``, target modules) and that its tensors keep the stream's rank.
Pure functions of what ``stream.json`` and the manifests say: no storage, no torch."""

from __future__ import annotations

from typing import Iterable, Sequence

from ..errors import AdapterMismatchError, StreamKindError
from ..format import STREAM_KIND_ADAPTER, STREAM_KIND_WEIGHTS, AdapterInfo

DEFAULT_KEEP = 2
"""Versions of an adapter stream served side by side unless told (``--keep``): the newest and the one before,
for the requests a rollout still sends to it."""

_KIND_PHRASES = {STREAM_KIND_WEIGHTS: "a weights stream (a model's full weights)",
                 STREAM_KIND_ADAPTER: "an adapter stream (LoRA adapters over a base model)"}
_KIND_HINTS = {
    (STREAM_KIND_ADAPTER, STREAM_KIND_WEIGHTS):
        "`ckptstream serve URL` serves its base model with each version as a LoRA adapter (or `ckptstream follow "
        "URL` beside a vLLM started with --enable-lora); `ckptstream info URL` names the base",
    (STREAM_KIND_WEIGHTS, STREAM_KIND_ADAPTER):
        "`ckptstream follow` and `ckptstream serve` serve it as a weights stream; here, give the URL of an adapter "
        "stream",
}

# PEFT's names of the two halves of a LoRA pair, and which dimension of each is the rank.
_LORA_PARTS = {".lora_A.weight": 0, ".lora_B.weight": 1, ".lora_embedding_A": 0, ".lora_embedding_B": 1}


def kind_error(url: str, *, kind: str, expected: str, hint: str | None = None) -> StreamKindError:
    """The error for a stream at ``url`` of ``kind`` where one of ``expected`` was needed, with the next step
    (``hint``, by default what to do for the pair of kinds)."""
    return StreamKindError(f"{url} is {_phrase(kind)}, not {_phrase(expected)}", url=url, kind=kind,
                           expected=expected, file="stream.json", hint=hint or _KIND_HINTS.get((kind, expected)))


def _phrase(kind: str) -> str:
    return _KIND_PHRASES.get(kind, f"a stream of kind {kind!r}")


def check_adapter_fits(info: AdapterInfo, *, base_hash: str | None, max_lora_rank: int | None,
                       version: int | None, target_modules: Iterable[str] | None = None,
                       server: str = "the server") -> None:
    """Refuse an adapter that a server cannot serve.

    Args:
        info: the stream's ``stream.json`` adapter block (``Stream.info().adapter``).
        base_hash: ``basehash.base_model_hash`` of the model directory the server runs (None: not checked; nor
            where the stream does not know its base's hash).
        max_lora_rank: the server's ``--max-lora-rank`` (None: not checked).
        version: the version to be served, named in the error.
        target_modules: the modules the server can adapt, by their last name (``q_proj``; None: not
            checked); the last name of each of the adapter's targets must be one of them.
        server: how the errors name the server (its URL, say).

    Raises:
        AdapterMismatchError: naming the version and what differs.
    """
    if base_hash is not None and info.base_hash is not None and base_hash != info.base_hash:
        raise AdapterMismatchError(
            f"the adapter is of base model {info.base_name} ({info.base_hash}), but the model of {server} hashes to "
            f"{base_hash}", version=version,
            hint="Serve the base model the adapter was trained on (`ckptstream info URL` names it)")
    if max_lora_rank is not None and info.rank > max_lora_rank:
        raise AdapterMismatchError(
            f"the adapter has rank {info.rank}, above {server}'s --max-lora-rank {max_lora_rank}", version=version,
            hint=f"Start vLLM with --max-lora-rank {info.rank} or more")
    if target_modules is not None:
        allowed = set(target_modules)
        missing = sorted(t for t in info.target_modules if t.rsplit(".", 1)[-1] not in allowed)
        if missing:
            raise AdapterMismatchError(
                f"the adapter targets modules {server} cannot adapt: {', '.join(missing)} (it can adapt "
                f"{', '.join(sorted(allowed)) or 'none'})", version=version,
                hint="Serve the base model the adapter was trained on, with LoRA support for those modules")


def check_adapter_tensors(info: AdapterInfo, tensors: Iterable[tuple[str, Sequence[int]]], *,
                          version: int | None) -> None:
    """Refuse a version whose LoRA tensors contradict the stream's adapter block: a rank above its rank, the
    two halves of one pair of different ranks, or a module its target modules do not cover (PEFT's rule: a
    module matches a target that is its name or a dot-separated suffix of it).

    Args:
        tensors: (name, shape) of each tensor of the version (a manifest's entries, or a snapshot's).

    Raises:
        AdapterMismatchError: naming the version and the tensor.
    """
    ranks: dict[str, tuple[str, int]] = {}  # module -> (the first half seen, its rank)
    for name, shape in tensors:
        part = next((p for p in _LORA_PARTS if name.endswith(p)), None)
        if part is None:
            continue  # not a LoRA tensor (modules_to_save): nothing to check
        module, axis = name[:-len(part)], _LORA_PARTS[part]
        if len(shape) != 2:
            raise AdapterMismatchError(f"a LoRA tensor of shape {list(shape)} (it needs two dimensions)",
                                       version=version, tensor=name, hint=_TENSOR_HINT)
        rank = shape[axis]
        if rank > info.rank:
            raise AdapterMismatchError(f"a LoRA tensor of rank {rank}, above the stream's rank {info.rank}",
                                       version=version, tensor=name, hint=_TENSOR_HINT)
        other = ranks.setdefault(module, (name, rank))
        if other[1] != rank:
            raise AdapterMismatchError(f"rank {rank}, but {other[0]} of the same module has rank {other[1]}",
                                       version=version, tensor=name, hint=_TENSOR_HINT)
        if info.target_modules and not any(_targets(target, module) for target in info.target_modules):
            raise AdapterMismatchError(f"a LoRA tensor of a module the stream's target modules "
                                       f"({', '.join(info.target_modules)}) do not cover", version=version,
                                       tensor=name, hint=_TENSOR_HINT)


_TENSOR_HINT = ("The version is not an adapter of this stream's configuration (adapter_config.json); "
                "publish the adapter to a stream of its own")


def _targets(target: str, module: str) -> bool:
    return module == target or module.endswith("." + target)
