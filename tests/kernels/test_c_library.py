"""kernels/specserve_kernels/c_library.py: where the C kernels' builds are kept."""
from __future__ import annotations

import os
import stat

from specserve_kernels import c_library


def test_the_build_is_not_loaded_from_a_directory_others_can_write(tmp_path, monkeypatch):
    """A shared library in a directory another user can write would run that user's code in the
    server: such a cache directory is passed over for a private one."""
    shared = tmp_path / "shared"
    (shared / "specserve").mkdir(parents=True)
    os.chmod(shared / "specserve", 0o777)
    monkeypatch.setenv("XDG_CACHE_HOME", str(shared))
    directory = c_library.cache_directory()
    assert directory != shared / "specserve"
    assert not directory.stat().st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    private = tmp_path / "private"
    monkeypatch.setenv("XDG_CACHE_HOME", str(private))
    directory = c_library.cache_directory()
    assert directory == private / "specserve" and stat.S_IMODE(directory.stat().st_mode) == 0o700
