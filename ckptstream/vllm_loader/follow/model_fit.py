"""Whether a version fits the model a server was started with: the same tensor names, dtypes and shapes. vLLM's
reload of one that does not fit fails half-way and leaves the engine dead, so the follower refuses it first."""

from __future__ import annotations

from pathlib import Path

from ...errors import ModelMismatchError
from ...format import Manifest
from ...hf import tensor_specs
from ..client import VllmControl, VllmError

Specs = dict[str, tuple[str, tuple[int, ...]]]
"""Tensor name -> (dtype, shape)."""


class ServedModelFit:
    """The served model's tensors (read once, from the model directory the server names, where readable here;
    else those of the first version adopted or checked), and the check of a version against them."""

    def __init__(self, client: VllmControl):
        self.client = client
        self.reference: Specs | None = None

    def adopt(self, manifest: Manifest) -> None:
        """The servers serve ``manifest``'s version: its tensors are the reference unless one is known."""
        self.reference = self.reference or manifest_specs(manifest)

    def check(self, manifest: Manifest) -> None:
        """Refuse (``ModelMismatchError``) a version whose tensors differ in name, dtype or shape from the
        served model's."""
        if self.reference is None:
            self.reference = self._served_specs() or manifest_specs(manifest)
        incoming, reference = manifest_specs(manifest), self.reference
        differing = [n for n in sorted(set(incoming) | set(reference)) if incoming.get(n) != reference.get(n)]
        if not differing:
            return
        problems = [f"{n}: {_spec_text(incoming.get(n))} where the served model has {_spec_text(reference.get(n))}"
                    for n in differing[:3]]
        raise ModelMismatchError(f"does not fit the served model ({len(differing)} tensors differ; "
                                 f"{'; '.join(problems)})", version=manifest.version, tensor=differing[0],
                                 hint="Refused before touching vLLM; the servers keep the previous version")

    def _served_specs(self) -> Specs | None:
        """The tensors of the model directory the server names (``/v1/models`` root), when readable here."""
        try:
            root = self.client.model_root()
        except VllmError:
            return None
        if root and Path(root).is_dir() and any(Path(root).glob("*.safetensors")):
            return tensor_specs(root)
        return None


def manifest_specs(manifest: Manifest) -> Specs:
    """A version's tensors: name -> (dtype, shape)."""
    return {t.name: (t.dtype, t.shape) for t in manifest.tensors}


def _spec_text(spec: tuple[str, tuple[int, ...]] | None) -> str:
    return "nothing" if spec is None else f"{spec[0]}{list(spec[1])}"
