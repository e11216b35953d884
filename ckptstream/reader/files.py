"""The data files of a stream's versions: checked against their manifest before any range of them is read,
then read range by range with every stored hash checked (FORMAT.md, "Reader obligations").

A manifest declares each file's size and every range inside it; a reader that trusted those numbers would
seek or allocate whatever a damaged or forged manifest says. So before the first read of a file its real
size must equal the declared one, and a keyframe file's safetensors header must describe exactly the
manifest's tensors of that file (names, dtypes, shapes, offsets). Each file is checked once per
``DataFiles`` (the most recent ``CHECKED_FILES_CACHE_SIZE`` are remembered).
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from .. import codec
from ..errors import IntegrityError
from ..format import (KEYFRAME, MAX_SAFETENSORS_HEADER_BYTES, SAFETENSORS_LENGTH, FileEntry, Hasher, Manifest,
                      TensorEntry, content_hash, data_path, loads_json)
from ..storage import RANGE_CHUNK_BYTES, Storage, chunk_spans

CHECKED_FILES_CACHE_SIZE = 4096
"""Data files whose size (and header) a ``DataFiles`` remembers having checked."""

_DAMAGED = "The version is damaged; publish a new keyframe or restore the file"


class DataFiles:
    """Checked access to the data files of one stream's versions (thread-safe)."""

    def __init__(self, storage: Storage):
        self.storage = storage
        self._checked: collections.OrderedDict[tuple[int, str], None] = collections.OrderedDict()
        self._checking: dict[tuple[int, str], threading.Lock] = {}
        self._lock = threading.Lock()

    def check(self, manifest: Manifest, name: str, tensor: str | None = None) -> None:
        """Refuse data file ``name`` of ``manifest`` unless its real size is the declared one and, for a keyframe,
        its safetensors header matches the manifest. ``tensor`` (the one about to be read) is named in
        errors.

        Raises:
            IntegrityError: naming the version, the file and ``tensor``.
        """
        key = (manifest.version, name)
        with self._lock:
            if key in self._checked:
                self._checked.move_to_end(key)
                return
            checking = self._checking.setdefault(key, threading.Lock())
        with checking:  # the decoding threads that start on one file at once check it once
            with self._lock:
                if key in self._checked:
                    return
            try:
                self._check(manifest, name, tensor)
                with self._lock:
                    self._checked[key] = None
                    while len(self._checked) > CHECKED_FILES_CACHE_SIZE:
                        self._checked.popitem(last=False)
            finally:
                with self._lock:
                    self._checking.pop(key, None)

    def _check(self, manifest: Manifest, name: str, tensor: str | None) -> None:
        file = next(f for f in manifest.files if f.name == name)  # parsing ensures tensors' files are listed
        path = data_path(manifest.version, file.name)
        try:
            size = self.storage.size(path)
        except FileNotFoundError:
            raise IntegrityError("data file is missing", version=manifest.version, file=path, tensor=tensor,
                                 hint=_DAMAGED) from None
        if size != file.size:
            raise IntegrityError(f"data file has {size} bytes, manifest says {file.size}"
                                 + (" (truncated)" if size < file.size else ""),
                                 version=manifest.version, file=path, tensor=tensor, hint=_DAMAGED)
        if manifest.kind == KEYFRAME:
            problem = self._header_problem(manifest, file)
            if problem is not None:
                self._refuse_header(manifest, file, problem, tensor)

    def verify_file(self, manifest: Manifest, file: FileEntry) -> None:
        """Read all of data file ``file`` of ``manifest``: its size and hash must be the manifest's; then
        :meth:`check` it (a keyframe's header too, also for a file no tensor is read from).

        Raises:
            IntegrityError: naming the version and the file.
        """
        path = data_path(manifest.version, file.name)
        try:
            size, digest = file_hash(self.storage, path)
        except FileNotFoundError:
            raise IntegrityError("data file is missing", version=manifest.version, file=path) from None
        if size != file.size:
            raise IntegrityError(f"data file has {size} bytes, manifest says {file.size} (truncated?)",
                                 version=manifest.version, file=path)
        _check_file_hash(manifest, file, digest)
        self.check(manifest, file.name)

    def read(self, manifest: Manifest, entry: TensorEntry, out: torch.Tensor | None = None) -> torch.Tensor:
        """The stored bytes of ``entry`` as a uint8 tensor (``out`` if given: uint8, ``entry.length``), its file
        checked first, the bytes checked against ``stored_hash``."""
        assert entry.file is not None
        self.check(manifest, entry.file, entry.name)
        path = data_path(manifest.version, entry.file)
        if out is None:
            out = torch.empty(entry.length, dtype=torch.uint8)
        assert out.dtype == torch.uint8 and out.numel() == entry.length and out.is_contiguous()
        self._read_range(manifest, path, entry, out)
        _check_stored(manifest, path, entry, out)
        return out

    def read_batch(self, manifest: Manifest, entries: Sequence[TensorEntry]) -> list[torch.Tensor]:
        """``read`` of each of ``entries`` (in their order), those lying back to back in one file read as one range
        of at most ``RANGE_CHUNK_BYTES``: a batch of small tensors (a MoE model's experts) costs a read or a few, not
        one each. (A range at most that long is what a later ``read`` of each, kept, finds whole; larger entries
        are read alone.) The tensors returned are views of their range's buffer, which each keeps alive."""
        stored: dict[int, torch.Tensor] = {}
        runs: list[list[int]] = []  # entries back to back in one file, by their places in ``entries``
        run_bytes = 0
        for i in sorted(range(len(entries)), key=lambda i: (str(entries[i].file), entries[i].offset)):
            entry = entries[i]
            last = entries[runs[-1][-1]] if runs else None
            if (last is not None and (last.file, last.offset + last.length) == (entry.file, entry.offset)
                    and run_bytes + entry.length <= RANGE_CHUNK_BYTES):
                runs[-1].append(i)
                run_bytes += entry.length
            else:
                runs.append([i])
                run_bytes = entry.length
        for run in runs:
            first, last = entries[run[0]], entries[run[-1]]
            assert first.file is not None
            self.check(manifest, first.file, first.name)
            path = data_path(manifest.version, first.file)
            data = torch.empty(last.offset + last.length - first.offset, dtype=torch.uint8)
            self._read_range(manifest, path, first, data)
            for i in run:
                entry = entries[i]
                stored[i] = data[entry.offset - first.offset:entry.offset - first.offset + entry.length]
                _check_stored(manifest, path, entry, stored[i])
        return [stored[i] for i in range(len(entries))]

    def _read_range(self, manifest: Manifest, path: str, first: TensorEntry, out: torch.Tensor) -> None:
        """Fill ``out`` with the bytes of ``path`` from ``first``'s on (``first``'s, or its and those after it), a
        large range as concurrent ranged reads (an object store serves each request at a fraction of the link; a
        file system does not mind). A file missing or short is named with ``first`` (its size was checked before:
        rare)."""
        buffer = codec.buffer_of(out)
        spans = [(start, buffer[start - first.offset:end - first.offset])
                 for start, end in chunk_spans(first.offset, first.offset + out.numel())]
        with _reading(manifest, path, first):
            if len(spans) > 1:
                self.storage.read_ranges_into(path, spans)
            else:
                self.storage.read_into(path, first.offset, buffer)

    def read_range(self, manifest: Manifest, entry: TensorEntry, start: int, out: torch.Tensor) -> None:
        """Fill ``out`` (uint8, contiguous) with the stored bytes of ``entry`` from byte ``start`` on, its file
        checked first. Not checked against ``stored_hash`` (that takes all of them): for a caller that
        checks what it decodes from them another way."""
        assert entry.file is not None and out.dtype == torch.uint8 and out.is_contiguous()
        assert 0 <= start and start + out.numel() <= entry.length
        self.check(manifest, entry.file, entry.name)
        path = data_path(manifest.version, entry.file)
        with _reading(manifest, path, entry):
            self.storage.read_into(path, entry.offset + start, codec.buffer_of(out))

    def will_read(self, manifest: Manifest, entry: TensorEntry, start: int, length: int) -> None:
        """Hint that the stored bytes ``[start, start + length)`` of ``entry`` are read soon
        (``Storage.will_read``)."""
        assert entry.file is not None
        self.storage.will_read(data_path(manifest.version, entry.file), entry.offset + start, length)

    def _header_problem(self, manifest: Manifest, file: FileEntry) -> tuple[str, str | None] | None:
        """What in a keyframe file's safetensors header disagrees with the manifest (and which tensor)."""
        path = data_path(manifest.version, file.name)
        if file.size < SAFETENSORS_LENGTH.size:
            return "the file is too short for a safetensors header", None
        (length,) = SAFETENSORS_LENGTH.unpack(self.storage.read(path, 0, SAFETENSORS_LENGTH.size))
        if length > min(MAX_SAFETENSORS_HEADER_BYTES, file.size - SAFETENSORS_LENGTH.size):
            return f"the safetensors header claims {length} bytes", None
        raw = self.storage.read(path, SAFETENSORS_LENGTH.size, SAFETENSORS_LENGTH.size + length)
        try:
            header: Any = loads_json(raw, version=manifest.version, file=path)
        except IntegrityError as exc:
            return f"the safetensors header is not valid ({exc})", None
        if not isinstance(header, dict):
            return "the safetensors header is not a JSON object", None
        data_start = SAFETENSORS_LENGTH.size + length
        expected = {t.name: t for whole in manifest.tensors for t in whole.stored_entries if t.file == file.name}
        for name, spec in header.items():
            if name == "__metadata__":
                continue
            entry = expected.pop(name, None)
            if entry is None:
                return "the file holds a tensor the manifest does not place in it", name
            want = {"dtype": entry.dtype, "shape": list(entry.shape),
                    "data_offsets": [entry.offset - data_start, entry.offset + entry.length - data_start]}
            if not isinstance(spec, dict) or any(spec.get(k) != v for k, v in want.items()):
                got = spec if not isinstance(spec, dict) else {k: spec.get(k) for k in want}
                return f"the file says {got}, the manifest {want}", name
        if expected:
            return "the manifest places a tensor in the file that its header lacks", next(iter(expected))
        return None

    def _refuse_header(self, manifest: Manifest, file: FileEntry, problem: tuple[str, str | None],
                       tensor: str | None) -> None:
        """Raise for a header that disagrees with the manifest: as a corrupt file if the file's hash says
        so, otherwise as a manifest that misdescribes its file."""
        path = data_path(manifest.version, file.name)
        _check_file_hash(manifest, file, file_hash(self.storage, path)[1])  # the whole file damaged?
        message, named = problem
        raise IntegrityError(f"the keyframe's safetensors header disagrees with the manifest: {message}",
                             version=manifest.version, file=path, tensor=named or tensor,
                             hint="The manifest does not describe its data file; refusing this version")


@contextlib.contextmanager
def _reading(manifest: Manifest, path: str, entry: TensorEntry) -> Iterator[None]:
    """A data file found missing or short while ``entry``'s bytes are read is an IntegrityError naming them."""
    try:
        yield
    except FileNotFoundError:
        raise IntegrityError("data file is missing", version=manifest.version, file=path, tensor=entry.name,
                             hint=_DAMAGED) from None
    except EOFError:
        raise IntegrityError("data file is truncated", version=manifest.version, file=path, tensor=entry.name,
                             hint=_DAMAGED) from None


def _check_stored(manifest: Manifest, path: str, entry: TensorEntry, stored: torch.Tensor) -> None:
    """Refuse ``entry``'s stored bytes unless they hash to its ``stored_hash``."""
    actual = content_hash(codec.buffer_of(stored))
    if actual != entry.stored_hash:
        raise IntegrityError(f"stored bytes hash mismatch (expected {entry.stored_hash}, got {actual})",
                             version=manifest.version, file=path, tensor=entry.name,
                             hint="The stored data is corrupt; this version cannot be used")


def _check_file_hash(manifest: Manifest, file: FileEntry, digest: str) -> None:
    if digest != file.hash:
        raise IntegrityError(f"data file hash mismatch (expected {file.hash}, got {digest})",
                             version=manifest.version, file=data_path(manifest.version, file.name),
                             hint="The stored data is corrupt; this version cannot be used")


def file_hash(storage: Storage, path: str, block: int = 8 << 20) -> tuple[int, str]:
    """Size and content hash of a stored file, read sequentially."""
    hasher = Hasher()
    size = 0
    with storage.open_read(path) as f:
        while data := f.read(block):
            hasher.update(data)
            size += len(data)
    return size, hasher.digest()
