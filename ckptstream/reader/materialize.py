"""Materialized directories: a version written as a plain Hugging Face directory, and read back as the
base of later deltas.

A directory is built under a temporary name beside its final path and renamed into place, so nobody
(vLLM, a follower's cache) ever sees it incomplete. The temporary directory ``.tmp-<32 hex>-<name>``
holds ``.lock``, a file its builder keeps ``flock``-ed for as long as it runs, and ``out``, the directory
being built. It appears under that name only once its lock is held (it is created as
``.tmp-<32 hex>.new`` and renamed). A killed build leaves its temporary directory behind, unlocked: the
next build of the same name removes every ``.tmp-<32 hex>-<name>`` sibling whose lock it can take (or
that has no lock file: an older ckptstream's debris) and leaves alone those still locked by a live build.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import json
import mmap
import os
import re
import shutil
import threading
import uuid
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch

from .. import codec
from ..errors import (CkptStreamError, IntegrityError, NotADirectoryOutputError, TensorNotFoundError,
                      UnsafeManifestError)
from ..locks import LOCK_FILE, try_lock, unlock
from ..format import (INDEX_FILE, MARKER_FILE, SAFETENSORS_LENGTH, TEMP_PREFIX, Manifest, TensorEntry, asset_path,
                      dumps_json, is_reserved_asset_name, loads_json, safetensors_header, shard_groups)
from .decode import BaseTensors, Writer

_BUILD_DIR = "out"



def build_directory(out_dir: str | os.PathLike[str], manifest: Manifest, *,
                    decode: Callable[[Writer], Iterator[int]], assets: Iterable[tuple[str, bytes]],
                    marker: Mapping[str, Any], overwrite: bool, shard_bytes: int,
                    progress: Callable[[int], None] | None = None, weights_file: str | None = None) -> Path:
    """Write the tensors of ``manifest`` as safetensors shards (with an index when there are several),
    then the ``assets`` and the ``marker`` file, into ``out_dir``, atomically (see the module docstring).

    Args:
        decode: decodes every tensor of the version through a writer, yielding each tensor's byte count.
        assets: (name, bytes) of each non-weight file.
        weights_file: write every tensor into one file of this name (an adapter's
            ``adapter_model.safetensors``), never sharded; None: ``model.safetensors`` or shards of at most
            ``shard_bytes`` with an index.
        overwrite: replace a non-empty ``out_dir`` (else FileExistsError).

    Raises:
        NotADirectoryOutputError: ``out_dir`` exists and is not a directory.
        FileExistsError: ``out_dir`` is not empty (at the start or when the build is done) and not ``overwrite``.
        UnsafeManifestError: an asset would replace a weight file, the index or the marker.
    """
    out = Path(out_dir).absolute()
    _check_output(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_builds(out)
    temp, lock = _claim_build_dir(out)
    try:
        build = temp / _BUILD_DIR
        build.mkdir()
        write_directory(build, manifest, decode=decode, assets=assets, marker=marker, shard_bytes=shard_bytes,
                        progress=progress, weights_file=weights_file)
        _check_output(out, overwrite)  # another build may have filled it meanwhile
        if out.exists() and any(out.iterdir()):
            os.rename(out, temp / "old")  # removed with the temporary directory
        os.replace(build, out)
    finally:
        shutil.rmtree(temp, ignore_errors=True)
        unlock(lock)
    return out


def write_directory(directory: Path, manifest: Manifest, *, decode: Callable[[Writer], Iterator[int]],
                    assets: Iterable[tuple[str, bytes]], marker: Mapping[str, Any], shard_bytes: int,
                    progress: Callable[[int], None] | None = None, weights_file: str | None = None) -> None:
    """Write the files of a materialized directory into ``directory``, an empty directory that the caller
    owns (it makes the result appear atomically, as ``build_directory`` does): the weights (in one
    ``weights_file`` where given, as ``build_directory``), the assets, then the marker, last, so that a
    directory with its marker is complete."""
    _write_weights(directory, manifest, decode, shard_bytes, progress, weights_file)
    for name, data in assets:
        if is_reserved_asset_name(name) or (directory / name).exists():
            raise UnsafeManifestError(f"asset {name!r} would replace a weight file, the index or the marker",
                                      file=asset_path(name), hint="The stream's stream.json is unsafe")
        (directory / name).write_bytes(data)
    with open(directory / MARKER_FILE, "xb") as f:
        f.write(dumps_json(dict(marker), what=MARKER_FILE))


def _check_output(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise NotADirectoryOutputError(f"{out} exists and is not a directory",
                                       hint="Give the path of a directory to create (or an existing one to "
                                            "replace with overwrite=True / --force)")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} exists and is not empty (pass overwrite=True / --force to replace it)")


def _write_weights(build: Path, manifest: Manifest, decode: Callable[[Writer], Iterator[int]], shard_bytes: int,
                   progress: Callable[[int], None] | None, weights_file: str | None) -> None:
    groups = (shard_groups([t.nbytes for t in manifest.tensors], shard_bytes) if weights_file is None
              else [list(range(len(manifest.tensors)))])
    weight_map: dict[str, str] = {}
    placement: dict[str, tuple[_OutputFile, int]] = {}  # tensor -> (its shard, its offset there)
    shards: list[_OutputFile] = []
    try:
        for index, group in enumerate(groups):
            file_name = (weights_file or "model.safetensors" if len(groups) == 1
                         else f"model-{index + 1:05d}-of-{len(groups):05d}.safetensors")
            entries = [manifest.tensors[i] for i in group]
            header, offsets = safetensors_header(((t.name, t.dtype, t.shape, t.nbytes) for t in entries),
                                                 {"format": "pt"})
            shard = _OutputFile(build / file_name, header, len(header) + sum(t.nbytes for t in entries),
                                mapped=(os.cpu_count() or 1) >= MAPPED_WRITES_MIN_CORES)
            shards.append(shard)
            for entry, offset in zip(entries, offsets):
                weight_map[entry.name] = file_name
                placement[entry.name] = (shard, offset)

        def write(entry: TensorEntry, data: torch.Tensor | memoryview, at: int = 0) -> int:
            # Each decoding thread writes its tensor's bytes in place: decode and write overlap.
            shard, offset = placement[entry.name]
            return shard.write(data, offset + at)

        for nbytes in decode(write):
            if progress:
                progress(nbytes)
    finally:
        with contextlib.ExitStack() as closing:  # every shard closed, the first error kept
            for shard in shards:
                closing.callback(shard.close)
    if len(groups) > 1:
        index_doc = {"metadata": {"total_size": manifest.full_bytes}, "weight_map": weight_map}
        (build / INDEX_FILE).write_bytes(dumps_json(index_doc, what=INDEX_FILE, indent=2))


MAPPED_WRITES_MIN_CORES = 4
"""Shards are written through a mapping (see ``_OutputFile``) on machines of at least this many cores:
there many decoding threads wait for a file's lock under ``pwrite`` (16 cores, the follower's
apply-one-delta of a 4.2 GB model to tmpfs: 1.91 s with ``pwrite``, 1.38 s mapped), while with two
threads ``pwrite`` costs less than the mapping's page faults (2 cores, 1.34 GB: 0.67 s against 0.84 s)."""


class _OutputFile:
    """A safetensors shard being written by the decoding threads, each at its own offsets: through a shared
    mapping of the file where asked (``mapped``) and the file system reserves blocks (Linux ``fallocate``),
    else with ``pwrite``.

    A file system takes a file's lock for the whole of every ``pwrite``, copy included, so the threads'
    writes into one shard run one at a time; copies into the mapping run side by side
    (:data:`MAPPED_WRITES_MIN_CORES`). Each write first reserves its own range: a write into a mapping
    that finds the disk full would be a SIGBUS, not an error, and nothing is reserved ahead of the bytes
    decoded (a forged manifest's sizes reserve nothing)."""

    def __init__(self, path: Path, header: bytes, size: int, *, mapped: bool):
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        self._map: mmap.mmap | None = None
        self._bytes: torch.Tensor | None = None
        self._map_bytes = 0
        try:
            os.pwrite(self._fd, header, 0)
            if mapped and size > len(header) and _reserve(self._fd, 0, len(header)):
                try:
                    os.ftruncate(self._fd, size)  # (sparse: no blocks yet)
                    self._map = mmap.mmap(self._fd, size)
                    self._map_bytes = size
                except OSError:  # a size the file system or the address space refuses: its decode fails
                    self._map = None
                else:
                    self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        except BaseException:
            self.close()
            raise

    def write(self, data: torch.Tensor | memoryview, at: int) -> int:
        """Write ``data`` at byte ``at`` of the file (thread-safe for disjoint ranges); returns its length.
        Raises OSError (a full disk among them)."""
        source = codec.as_bytes(data) if isinstance(data, torch.Tensor) else None
        length = source.numel() if source is not None else len(data)
        if not length:
            return 0
        if self._bytes is not None:
            # whole pages: a write fault allocates every block of its page (64 KiB pages on some hosts)
            start = at - at % mmap.PAGESIZE
            end = min(-(-(at + length) // mmap.PAGESIZE) * mmap.PAGESIZE, self._map_bytes)
            if not _reserve(self._fd, start, end - start):
                raise OSError(errno.EOPNOTSUPP, "the file system stopped reserving blocks")
            if source is None:
                source = torch.frombuffer(data, dtype=torch.uint8)
            self._bytes[at:at + length].copy_(source)
            return length
        view = codec.buffer_of(source) if source is not None else data
        written = 0
        while written < length:
            written += os.pwrite(self._fd, view[written:], at + written)
        return written

    def close(self) -> None:
        """Unmap and close the file. Only once no write runs (the decoding threads are joined before):
        the mapping goes even while tensors view it, and a write into it then would fault."""
        self._bytes = None
        try:
            if self._map is not None:
                self._map.close()
                self._map = None
        finally:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


def _reserve(fd: int, offset: int, length: int) -> bool:
    """Reserve the blocks of the file's bytes ``[offset, offset + length)``; False where the file system
    cannot (NFSv3, macOS). Raises OSError where space is short."""
    fallocate = _fallocate()
    if fallocate is None:
        return False
    if fallocate(fd, 0, offset, length) == 0:
        return True
    error = ctypes.get_errno()
    if error in (errno.EOPNOTSUPP, errno.ENOSYS, errno.ENODEV):
        return False
    raise OSError(error, os.strerror(error))


@functools.cache
def _fallocate() -> Any:
    """Linux's ``fallocate(2)`` through the C library (``os.posix_fallocate`` would fall back to writing
    zeros where the file system cannot reserve: twice the writes), or None."""
    try:
        function = ctypes.CDLL(None, use_errno=True).fallocate
    except (AttributeError, OSError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    function.restype = ctypes.c_int
    return function


def _build_dir_pattern(name: str) -> re.Pattern[str]:
    return re.compile(re.escape(TEMP_PREFIX) + "[0-9a-f]{32}-" + re.escape(name))


def _claim_build_dir(out: Path) -> tuple[Path, int]:
    """A new temporary build directory beside ``out`` and the descriptor of its held lock."""
    token = uuid.uuid4().hex
    staging = out.parent / f"{TEMP_PREFIX}{token}.new"  # not a name any build removes
    staging.mkdir()
    lock = None
    try:
        lock = try_lock(staging / LOCK_FILE)
        assert lock is not None  # a new file in a new directory: nobody else can hold it
        temp = out.parent / f"{TEMP_PREFIX}{token}-{out.name}"
        os.rename(staging, temp)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        if lock is not None:
            unlock(lock)
        raise
    return temp, lock


def remove_stale_builds(out: str | os.PathLike[str]) -> list[Path]:
    """Remove the temporary build directories of ``out`` left by killed builds (those whose lock can be
    taken, or without a lock file); live builds' are kept. Returns the removed paths."""
    out = Path(out).absolute()
    pattern = _build_dir_pattern(out.name)
    removed = []
    try:
        children = list(out.parent.iterdir())
    except FileNotFoundError:
        return removed
    for child in children:
        if not pattern.fullmatch(child.name) or child.is_symlink() or not child.is_dir():
            continue
        lock = None
        if (child / LOCK_FILE).exists():  # else an older ckptstream's debris, or a finished build's leftovers
            try:
                lock = try_lock(child / LOCK_FILE, create=False)
            except OSError:
                continue
            if lock is None:
                continue  # a live build (or one that just finished and removed its lock)
        try:
            shutil.rmtree(child, ignore_errors=True)
            removed.append(child)
        finally:
            if lock is not None:
                unlock(lock)
    return removed


class MaterializedBase(BaseTensors):
    """Tensors of a directory written by ``Stream.materialize``, used as the start of delta decoding.

    Raises:
        CkptStreamError: the directory was not materialized from this stream.
        IntegrityError: one of its safetensors files cannot be read (truncated or corrupt), naming it.
    """

    def __init__(self, directory: str | os.PathLike[str], stream_id: str):
        from safetensors import SafetensorError, safe_open

        self.directory = Path(directory)
        try:
            marker = loads_json((self.directory / MARKER_FILE).read_bytes(), version=None, file=MARKER_FILE)
            self.version = int(marker["version"])
            foreign = marker["stream_id"] != stream_id
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CkptStreamError(f"{self.directory} is not a directory materialized by ckptstream ({exc})",
                                  hint="Pass a directory written by `ckptstream materialize`") from None
        if foreign:
            raise CkptStreamError(f"{self.directory} was materialized from another stream",
                                  hint="Pass a directory materialized from this stream")
        self._files = []
        for path in sorted(self.directory.glob("*.safetensors")):
            try:
                self._files.append(safe_open(str(path), framework="pt"))
            except (SafetensorError, OSError) as exc:
                raise IntegrityError(f"the local copy of version {self.version} is damaged ({exc})",
                                     file=str(path),
                                     hint="Materialize this version without the base directory, or delete "
                                          "the directory") from None
        self._where = {name: f for f in self._files for name in f.keys()}
        # Where each tensor's bytes lie, for reads straight into a decode buffer (safe_open has checked the
        # headers: offsets inside the file, sizes matching dtype and shape).
        self._spans: dict[str, tuple[int, int, str, tuple[int, ...]]] = {}
        self._fds: list[int] = []
        self._maps: dict[int, mmap.mmap] = {}  # descriptor -> its file mapped, once gathered from
        self._map_lock = threading.Lock()
        for path in sorted(self.directory.glob("*.safetensors")):
            fd = os.open(path, os.O_RDONLY)
            self._fds.append(fd)
            (length,) = SAFETENSORS_LENGTH.unpack(os.pread(fd, SAFETENSORS_LENGTH.size, 0))
            header = json.loads(os.pread(fd, length, SAFETENSORS_LENGTH.size))
            for name, spec in header.items():
                if name != "__metadata__":
                    self._spans[name] = (fd, SAFETENSORS_LENGTH.size + length + spec["data_offsets"][0],
                                         spec["dtype"], tuple(spec["shape"]))

    def names(self) -> list[str]:
        return list(self._where)

    def load(self, name: str) -> torch.Tensor | None:
        f = self._where.get(name)
        return None if f is None else f.get_tensor(name).clone()

    def read_into(self, entry: TensorEntry, out: torch.Tensor, offset: int = 0) -> bool:
        span = self._spans.get(entry.name)
        if span is None:
            return False
        fd, start, dtype, shape = span
        if (dtype, shape) != (entry.dtype, entry.shape):
            raise IntegrityError(f"the given base copy has {dtype}{list(shape)}, the base version "
                                 f"{entry.dtype}{list(entry.shape)}", version=self.version, tensor=entry.name,
                                 hint="The local base directory is stale or foreign; materialize it again")
        assert 0 <= offset and offset + out.numel() <= entry.nbytes
        buffer = codec.buffer_of(out)
        done = 0
        while done < len(buffer):
            n = os.preadv(fd, [buffer[done:]], start + offset + done)
            if n <= 0:
                raise IntegrityError("the local copy is truncated", version=self.version, tensor=entry.name,
                                     hint="Materialize this version without the base directory, or delete "
                                          "the directory")
            done += n
        return True

    def gather(self, entry: TensorEntry, positions: torch.Tensor) -> torch.Tensor:
        """The elements at the flat ``positions`` (int64, each below its size) of the tensor ``entry``
        names, as integers of its width, read through a memory map of its file (only the pages holding
        them are touched). Raises TensorNotFoundError if it lacks it, IntegrityError as :meth:`read_into`."""
        span = self._spans.get(entry.name)
        if span is None:
            raise TensorNotFoundError("the local copy lacks this tensor", version=self.version, tensor=entry.name,
                                      hint="The local base directory is stale or foreign; materialize it again")
        fd, start, dtype, shape = span
        if (dtype, shape) != (entry.dtype, entry.shape):
            self.read_into(entry, torch.empty(0, dtype=torch.uint8))  # (raises, naming both)
        int_dtype = codec.INT_OF_SIZE[entry.itemsize]
        if start % entry.itemsize:  # (no aligned view: read it whole)
            whole = torch.empty(entry.nbytes, dtype=torch.uint8)
            self.read_into(entry, whole)
            return whole.view(int_dtype)[positions]
        with self._map_lock:
            if fd not in self._maps:
                self._maps[fd] = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)  # (private: never writes the file)
        mapped = self._maps[fd]
        if start + entry.nbytes > len(mapped):
            raise IntegrityError("the local copy is truncated", version=self.version, tensor=entry.name,
                                 hint="Materialize this version without the base directory, or delete the directory")
        elements = torch.frombuffer(mapped, dtype=int_dtype, count=entry.numel, offset=start)
        return elements[positions]

    def close(self) -> None:
        for mapped in self._maps.values():
            mapped.close()  # (no view outlives gather)
        self._maps.clear()
        self._files.clear()
        self._where.clear()
        self._spans.clear()
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()
