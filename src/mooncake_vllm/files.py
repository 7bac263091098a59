"""Reading small input files safely: regular files only, bounded by the bytes actually read.

A config path or a launch script can be a FIFO (``open`` would block forever), a
symlink to ``/dev/zero`` (``read()`` would never end) or a /proc file whose
``st_size`` is 0. :func:`read_regular` opens non-blocking, checks the opened
file with ``fstat`` and stops reading one byte past the limit.
"""

from __future__ import annotations

import os
import stat

from mooncake_vllm.errors import NotRegularFileError, TooLargeError

__all__ = ["read_regular"]


def read_regular(path: str | os.PathLike[str], limit: int, *, follow: bool = True) -> bytes:
    """The bytes of regular file ``path``, at most ``limit`` of them.

    ``follow=False`` refuses a symlink as the last component (``O_NOFOLLOW``).
    Raises :class:`NotRegularFileError`, :class:`TooLargeError` or the ``OSError`` of open/read.
    """
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    if not follow:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(path, flags)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise NotRegularFileError(f"{os.fspath(path)} is not a regular file (a FIFO, device, socket or "
                                      "directory)")
        if info.st_size > limit:
            raise TooLargeError(f"{os.fspath(path)} is {info.st_size} bytes, more than {limit}", info.st_size)
        os.set_blocking(fd, True)
        chunks: list[bytes] = []
        total = 0
        while total <= limit:  # the limit holds on what is read, not on what stat says
            chunk = os.read(fd, min(1 << 20, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
        if total > limit:
            raise TooLargeError(f"{os.fspath(path)} holds more than {limit} bytes", total)
        return b"".join(chunks)
    finally:
        os.close(fd)
