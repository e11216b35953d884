"""Reading Hugging Face model directories: weights (safetensors) and the non-weight files beside them."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import torch

from .errors import IntegrityError, SourceNotFoundError
from .format import is_reserved_asset_name, is_safe_file_name


def hf_assets(directory: str | os.PathLike[str]) -> dict[str, bytes]:
    """The non-weight files of a model directory (config.json, tokenizer files, generation_config.json):
    every plain top-level file that is not a weight file, a weight index or hidden."""
    root = Path(directory)
    if not root.is_dir():
        raise FileNotFoundError(f"{root} is not a directory")
    assets = {}
    for path in sorted(root.iterdir()):
        name = path.name
        if not path.is_file() or is_reserved_asset_name(name) or not is_safe_file_name(name):
            continue
        assets[name] = path.read_bytes()
    return assets


def iter_hf_weights(directory: str | os.PathLike[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of the safetensors files of a model directory."""
    from safetensors import safe_open

    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise SourceNotFoundError(f"no *.safetensors files in {directory}",
                                  hint="Give a Hugging Face model directory holding the weights as safetensors; "
                                       "nothing was published")
    seen: set[str] = set()
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if name in seen:
                    raise ValueError(f"tensor {name!r} appears in more than one file of {directory}")
                seen.add(name)
                yield name, f.get_tensor(name)


def tensor_specs(directory: str | os.PathLike[str]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Name -> (safetensors dtype, shape) of every tensor in a model directory, from the file headers
    only (no tensor data is read)."""
    return {name: (dtype, shape) for name, (_, dtype, shape) in tensor_files(directory).items()}


def tensor_files(directory: str | os.PathLike[str]) -> dict[str, tuple[Path, str, tuple[int, ...]]]:
    """Name -> (the safetensors file holding it, its dtype, its shape) of every tensor in a model directory, from
    the file headers only; a header that cannot be read is an ``IntegrityError`` naming its file."""
    from safetensors import SafetensorError, safe_open

    files = {}
    for path in sorted(Path(directory).glob("*.safetensors")):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    piece = f.get_slice(name)
                    files[name] = (path, piece.get_dtype(), tuple(piece.get_shape()))
        except SafetensorError as exc:
            raise IntegrityError(f"its safetensors header cannot be read ({exc})", file=str(path),
                                 hint="The file is truncated or not a safetensors file") from exc
    return files
