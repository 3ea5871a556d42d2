"""The private directory of one tritonserver's models: where their IPC sockets live.

Every Python model of a server is a child process of that tritonserver, so the models find one
another's sockets in one directory of their server:

    $SPECSERVE_RUNTIME_DIR        set by serving/launch/launcher.py: made with mkdtemp (mode 0700, a name
                                  no other user can guess) for each server it starts
    {tmp}/specserve-{uid}-{ppid}  otherwise (tritonserver started by hand): made mode 0700 by the
                                  first model that needs it

Either way the directory must be a real directory owned by this user and closed to every other
(no group or other permission bits): one made first by somebody else is refused, never used.
"""
from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

RUNTIME_DIR_VARIABLE = "SPECSERVE_RUNTIME_DIR"


class UnsafeDirectoryError(RuntimeError):
    """The directory exists but another user could reach into it."""


def runtime_directory(server_pid: int | None = None) -> Path:
    """This server's private directory, made if it does not exist yet."""
    explicit = os.environ.get(RUNTIME_DIR_VARIABLE)
    if explicit:
        return checked(Path(explicit))
    server_pid = os.getppid() if server_pid is None else server_pid
    return private_subdirectory(Path(tempfile.gettempdir()), f"specserve-{os.getuid()}-{server_pid}")


def private_subdirectory(parent: Path, name: str) -> Path:
    """`parent / name`, made mode 0700 unless it exists; an existing one must pass `checked`."""
    path = parent / name
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    return checked(path)


def checked(path: Path) -> Path:
    """`path` if it is a directory (not a link) owned by this user with no group or other access."""
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafeDirectoryError(f"{path} is not a directory (a link or a file); refusing to use it")
    if info.st_uid != os.getuid():
        raise UnsafeDirectoryError(f"{path} belongs to uid {info.st_uid}, not to this user; refusing to use it")
    if info.st_mode & 0o077:
        raise UnsafeDirectoryError(
            f"{path} is open to other users (mode {stat.S_IMODE(info.st_mode):o}); it must be 0700"
        )
    return path
