"""Shared memory between the processes of one EPP pod: a file mapped by every process.

A plain file in a private directory (on /dev/shm where there is one, so it never touches a
disk) and `mmap`, rather than `multiprocessing.shared_memory`: processes started any way can map
it by path, and no resource tracker unlinks it behind the owner's back when a child exits. The
owner (the supervisor) creates the directory and removes it at the end.

The hot path never locks: every shared value has one writer and is one aligned 8-byte word,
which the processor stores and loads whole (x86-64 and arm64 alike). The file lock is only for
rare table changes (an endpoint taking or giving back a row).
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


def shared_directory(prefix: str = "epp-") -> Path:
    """A new private directory for a pod's shared files, in memory where the system allows."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    return Path(tempfile.mkdtemp(prefix=prefix, dir=base))


def remove_directory(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


class SharedFile:
    """A file of `size` bytes mapped read-write; `view` is a memoryview over all of it."""

    def __init__(self, path: Path, size: int, *, create: bool) -> None:
        self.path = path
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)  # zero-filled
            elif os.fstat(fd).st_size < size:
                raise ValueError(f"{path}: {os.fstat(fd).st_size} bytes, expected {size}")
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.view = memoryview(self._map)

    def close(self) -> None:
        self.view.release()
        with contextlib.suppress(BufferError):  # a cast view still alive keeps it mapped until exit
            self._map.close()


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive lock shared by every process of the pod (flock on a lock file)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
