"""Hostile environments: a full disk, a read-only mount, a lock held by another process."""
from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path

import pytest

from .run import stage_env


def _mount(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["mount", *args], capture_output=True, text=True)


def _need_mount(r: subprocess.CompletedProcess, what: str) -> None:
    if r.returncode != 0:
        pytest.skip(f"{what} needs mount (root or CAP_SYS_ADMIN), refused here: {r.stderr.strip()}")


@contextlib.contextmanager
def small_disk(path: Path, size: str):
    """A tmpfs of `size` (e.g. "256k") at `path`: writing past it fails with a real ENOSPC."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    _need_mount(_mount("-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(path)), "a disk-full test")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def resize_disk(path: Path, size: str) -> None:
    r = _mount("-o", f"remount,size={size}", str(path))
    assert r.returncode == 0, r.stderr


@contextlib.contextmanager
def read_only(path: Path):
    """`path` bind-mounted onto itself read-only: writes below it fail with EROFS, even as root
    (chmod does not stop root)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    _need_mount(_mount("--bind", str(path), str(path)), "a read-only output test")
    try:
        r = _mount("-o", "remount,bind,ro", str(path))
        assert r.returncode == 0, r.stderr
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


_HOLDER = """
import sys, time
from eagle3_train.common.store import DirLock
lock = DirLock(sys.argv[1], sys.argv[2]).__enter__()
print("locked", flush=True)
time.sleep(600)
"""


@contextlib.contextmanager
def lock_held(directory: Path, stage: str):
    """Another process holding `directory`'s lock the way a running stage does (store.DirLock)."""
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(directory), stage], stdout=subprocess.PIPE,
                            text=True, env=stage_env())
    try:
        assert proc.stdout.readline().strip() == "locked", "the lock holder did not start"
        yield proc
    finally:
        proc.kill()
        proc.wait()
