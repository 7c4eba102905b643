"""Another owner's socket (gRPC core's, uvicorn's), used for a moment through a duplicate of its descriptor.

The owner may close the descriptor at any time and the number be reused by another file: the duplicate is checked
against the inode the caller found, and only the duplicate is ever closed here, so the owner's socket stays open
until the owner closes it (a shutdown, a filter or a reading through the duplicate act on the socket itself)."""

from __future__ import annotations

import errno
import os
import socket


def borrowed(fd: int, inode: int) -> socket.socket:
    """A socket object on a duplicate of ``fd``, which must still be the socket ``inode``; closing it (a ``with``)
    closes the duplicate only. OSError: EBADF where ``fd`` is closed, ESTALE where it now holds another file."""
    duplicate = os.dup(fd)
    try:
        if os.fstat(duplicate).st_ino != inode:
            raise OSError(errno.ESTALE, "the descriptor now holds another file")
        return socket.socket(fileno=duplicate)
    except BaseException:
        os.close(duplicate)
        raise
