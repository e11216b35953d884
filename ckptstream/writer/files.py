"""Writing a version's data files: keyframe shards (plain safetensors) and delta files (zstd frames),
under names unique to this writer, and removing them again when the version is abandoned."""

from __future__ import annotations

import logging

from .. import codec
from ..format import (DELTA, ENCODING_UNCHANGED, KEYFRAME, FileEntry, Hasher, TensorEntry, data_path,
                      safetensors_header, shard_groups)
from ..storage import Storage
from .commit import data_file_name
from .encode import EncodedVersion

log = logging.getLogger("ckptstream.publish")


class DataFileWriter:
    """Writes the data files of encoded versions to ``storage``, at most ``shard_bytes`` per file, each
    under a name carrying ``writer_id``."""

    def __init__(self, storage: Storage, writer_id: str, shard_bytes: int):
        self.storage = storage
        self.writer_id = writer_id
        self.shard_bytes = shard_bytes

    def write(self, version: int, encoded: EncodedVersion,
              hashes: list[str]) -> tuple[list[FileEntry], list[TensorEntry]]:
        """Write the files of ``version``; return their entries and the manifest's entry of every tensor
        (in ``encoded``'s order). ``hashes`` are the decoded tensors' hashes, in the same order."""
        if encoded.kind == KEYFRAME:
            return self._write_keyframe(version, encoded, hashes)
        return self._write_delta(version, encoded, hashes)

    def remove(self, version: int, files: list[FileEntry]) -> None:
        """Remove files this writer wrote for a version that will not be committed (failures are left
        for ``ckptstream gc``)."""
        for entry in files:
            try:
                self.storage.delete(data_path(version, entry.name))
            except OSError as exc:
                log.warning("version %d: cannot remove %s (left for `ckptstream gc`): %s", version, entry.name, exc)

    def _write_keyframe(self, version: int, encoded: EncodedVersion, hashes: list[str]
                        ) -> tuple[list[FileEntry], list[TensorEntry]]:
        tensors = encoded.tensors
        groups = shard_groups([t.tensor.numel() * t.tensor.element_size() for t in tensors], self.shard_bytes)
        files, entries = [], []
        for index, group in enumerate(groups):
            name = data_file_name(KEYFRAME, self.writer_id, index, len(groups))
            members = [(tensors[i], hashes[i]) for i in group]
            header, offsets = safetensors_header(
                ((t.name, codec.dtype_name(t.tensor.dtype), tuple(t.tensor.shape),
                  t.tensor.numel() * t.tensor.element_size()) for t, _ in members),
                {"format": "pt", "ckptstream_version": str(version)})
            file_hasher = Hasher()
            size = len(header)
            with self.storage.open_write(data_path(version, name)) as f:
                f.write(header)
                file_hasher.update(header)
                for (item, digest), offset in zip(members, offsets):
                    data = codec.buffer_of(codec.as_bytes(item.tensor))
                    f.write(data)
                    file_hasher.update(data)
                    size += len(data)
                    entries.append(TensorEntry(name=item.name, dtype=codec.dtype_name(item.tensor.dtype),
                                               shape=tuple(item.tensor.shape), hash=digest, encoding=item.encoding,
                                               file=name, offset=offset, length=len(data), stored_hash=digest))
            files.append(FileEntry(name, size, file_hasher.digest()))
        return files, entries

    def _write_delta(self, version: int, encoded: EncodedVersion, hashes: list[str]
                     ) -> tuple[list[FileEntry], list[TensorEntry]]:
        tensors = encoded.tensors
        entries: list[TensorEntry | None] = [None] * len(tensors)
        for i, item in enumerate(tensors):
            if item.encoding == ENCODING_UNCHANGED:
                entries[i] = TensorEntry(name=item.name, dtype=codec.dtype_name(item.tensor.dtype),
                                         shape=tuple(item.tensor.shape), hash=hashes[i], encoding=ENCODING_UNCHANGED,
                                         changed=0)
        stored_indices = [i for i, item in enumerate(tensors) if item.encoding != ENCODING_UNCHANGED]
        groups = shard_groups([sum(len(f) for f in tensors[i].frames) for i in stored_indices], self.shard_bytes)
        files = []
        for number, group in enumerate(groups):
            name = data_file_name(DELTA, self.writer_id, number, len(groups))
            file_hasher = Hasher()
            position = 0
            with self.storage.open_write(data_path(version, name)) as f:
                for i in (stored_indices[g] for g in group):
                    item = tensors[i]
                    stored_hasher = Hasher()
                    for frame in item.frames:
                        f.write(frame)
                        file_hasher.update(frame)
                        stored_hasher.update(frame)
                    length = sum(len(frame) for frame in item.frames)
                    entries[i] = TensorEntry(
                        name=item.name, dtype=codec.dtype_name(item.tensor.dtype), shape=tuple(item.tensor.shape),
                        hash=hashes[i], encoding=item.encoding, file=name, offset=position, length=length,
                        stored_hash=stored_hasher.digest(), shuffle=encoded.shuffle, chunks=tuple(item.chunks),
                        changed=item.changed, check=item.check)
                    position += length
            files.append(FileEntry(name, position, file_hasher.digest()))
        assert all(e is not None for e in entries)
        return files, [e for e in entries if e is not None]
