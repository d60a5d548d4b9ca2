"""A size-limited filesystem for tests: a tmpfs mounted for the test, and a file that fills it.

    with mounted_tmpfs(tmp_path / "fs", mib=32) as mnt:   # skips the test where it cannot mount
        filler = fill(mnt, leave_bytes=16 << 10)
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path

import pytest


@contextlib.contextmanager
def mounted_tmpfs(mnt: Path, mib: float):
    """A tmpfs of `mib` MiB at `mnt` (created), unmounted after (skipped when this machine cannot mount one)."""
    mnt.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("mounting a size-limited tmpfs needs root (CAP_SYS_ADMIN)")
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={int(mib * 1024)}k,mode=0700", "tmpfs", str(mnt)],
                              capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"cannot run mount for a size-limited tmpfs: {exc}")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a size-limited tmpfs here: {done.stderr.strip() or done.returncode}")
    try:
        yield mnt
    finally:
        undone = subprocess.run(["umount", str(mnt)], capture_output=True, text=True, timeout=20)
        if undone.returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True, text=True, timeout=20)


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def fill(path: Path, leave_bytes: int) -> Path:
    """A file that takes all free space of the filesystem but leave_bytes."""
    filler = path / "filler"
    size = free_bytes(path) - leave_bytes
    assert size > 0
    fd = os.open(filler, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
    finally:
        os.close(fd)
    assert free_bytes(path) == leave_bytes
    return filler
