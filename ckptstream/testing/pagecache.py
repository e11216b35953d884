"""What a process read of files, counted in the page cache (Linux): drop the files' pages, let it read, count
the pages back (``mincore``). For files on a disk-backed file system (a tmpfs keeps every page resident), with
nothing else reading them meanwhile and no map of them alive while they are dropped."""

from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Iterable
from pathlib import Path

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)
_MAP_FAILED = ctypes.c_void_p(-1).value


def drop_pages(paths: Iterable[str | os.PathLike[str]]) -> None:
    """Write the files' dirty pages out, then drop their pages from the page cache."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # (a dirty page cannot be dropped)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident_bytes(paths: Iterable[str | os.PathLike[str]]) -> int:
    """Bytes of the files' pages now in the page cache (counting does not read them)."""
    total = 0
    for path in paths:
        size = Path(path).stat().st_size
        if size == 0:
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            address = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if address == _MAP_FAILED:
                raise OSError(ctypes.get_errno(), f"mmap of {path} failed")
            try:
                pages = ctypes.create_string_buffer(-(-size // mmap.PAGESIZE))
                if _libc.mincore(address, size, pages) != 0:
                    raise OSError(ctypes.get_errno(), f"mincore of {path} failed")
                total += min(size, sum(byte & 1 for byte in pages.raw) * mmap.PAGESIZE)
            finally:
                _libc.munmap(address, size)
        finally:
            os.close(fd)
    return total
