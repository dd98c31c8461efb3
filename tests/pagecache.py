"""What of a file the kernel's page cache holds, and making a file cold again."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
from pathlib import Path


def resident(path: Path, start: int, end: int) -> int:
    """Pages of [start, end) of the file in the page cache: what was read of it (or written) since it was
    made. Mapping a file faults nothing in; mincore says which of its pages are cached."""
    start -= start % mmap.PAGESIZE
    end = min(end, path.stat().st_size)
    if end <= start:
        return 0
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    length = end - start
    vec = (ctypes.c_ubyte * -(-length // mmap.PAGESIZE))()
    with open(path, "rb") as f:
        address = libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, f.fileno(), start)
        assert address not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        try:
            assert libc.mincore(address, length, vec) == 0, os.strerror(ctypes.get_errno())
        finally:
            libc.munmap(address, length)
    return sum(v & 1 for v in vec)


def evict(path: Path) -> None:
    """The file's pages written back and dropped from the page cache, as memory pressure would (clean pages
    that no process maps go; the caller checks with resident)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
