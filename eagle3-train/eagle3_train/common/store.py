"""Files that survive kill -9: atomic writes, append-only JSONL with a torn last line tolerated,
the output-directory lock, and "work still to do" as a pure function.

Every stage writes through these helpers; none opens its outputs with a bare open(..., "w").
"""

from __future__ import annotations

import datetime as _dt
import errno
import fcntl
import hashlib
import json
import os
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from eagle3_train.common.errors import PipelineError

TMP_PREFIX = ".tmp-"  # readers and resumers ignore (and clean) files with this prefix


# ----------------------------------------------------------------------------- atomic writes

def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to a temp file in the same directory, fsync, then rename over `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX + path.name + ".", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; outputs should read like any file
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        _unlink_quiet(tmp)
        raise
    fsync_dir(path.parent)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def atomic_write_json(path: Path, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def atomic_dir_commit(tmp_dir: Path, final_dir: Path) -> None:
    """Move a fully written temp directory into place (the previous one, if any, is replaced)."""
    final_dir = Path(final_dir)
    old = None
    if final_dir.exists():
        old = final_dir.with_name(TMP_PREFIX + final_dir.name + ".old")
        if old.exists():
            _rmtree(old)
        os.replace(final_dir, old)
    os.replace(tmp_dir, final_dir)
    fsync_dir(final_dir.parent)
    if old is not None:
        _rmtree(old)


def move_aside(directory: Path, names: Iterable[str] | None = None) -> Path | None:
    """--overwrite: move a previous output into `<directory>/replaced-<UTC time>/`; never delete.

    `names` are the entries to move (default: everything but the lock and earlier replaced-*).
    The manifest goes first, so from that moment the directory no longer claims to be complete.
    Returns the new folder, or None if there was nothing to move."""
    directory = Path(directory)
    if not directory.is_dir():
        return None
    keep = {".lock", ".locks"}
    if names is None:
        names = [p.name for p in directory.iterdir() if p.name not in keep and not p.name.startswith("replaced-")]
    present = sorted((n for n in names if (directory / n).exists()), key=lambda n: n != "manifest.json")
    if not present:
        return None
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    dest, n = directory / f"replaced-{stamp}", 0
    while dest.exists():
        n += 1
        dest = directory / f"replaced-{stamp}-{n}"
    dest.mkdir()
    for name in present:
        os.replace(directory / name, dest / name)
    fsync_dir(directory)
    return dest


def clean_temp_files(directory: Path) -> int:
    """Remove leftovers of interrupted atomic writes; returns how many were removed."""
    n = 0
    directory = Path(directory)
    if not directory.is_dir():
        return 0
    for p in directory.iterdir():
        if p.name.startswith(TMP_PREFIX):
            _rmtree(p) if p.is_dir() else _unlink_quiet(p)
            n += 1
    return n


def _rmtree(p: Path) -> None:
    import shutil

    shutil.rmtree(p, ignore_errors=True)


def _unlink_quiet(p) -> None:
    try:
        os.unlink(p)
    except FileNotFoundError:
        pass


def fsync_dir(d: Path) -> None:
    """Make a rename or a new file in `d` durable (best effort: some file systems refuse)."""
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------- hashing

def file_sha256(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


class ByteDigest:
    """sha256 and byte count of what a reader fed it (jsonl_lines' `digest`)."""

    def __init__(self):
        self._h = hashlib.sha256()
        self.size = 0

    def update(self, data: bytes) -> None:
        self._h.update(data)
        self.size += len(data)

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def json_sha256(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


# ----------------------------------------------------------------------------- JSONL

def repair_torn_tail(path: Path) -> int:
    """Cut a partial last line (a write interrupted by kill -9); returns bytes removed."""
    path = Path(path)
    if not path.exists():
        return 0
    size = path.stat().st_size
    if size == 0:
        return 0
    with open(path, "rb+") as f:
        # Scan back from the end for the last newline; only the tail after it can be torn.
        pos, step = size, 1 << 16
        while pos > 0:
            start = max(0, pos - step)
            f.seek(start)
            block = f.read(pos - start)
            nl = block.rfind(b"\n")
            if nl >= 0:
                keep = start + nl + 1
                break
            pos = start
        else:
            keep = 0
        if keep == size:
            return 0
        f.truncate(keep)
        f.flush()
        os.fsync(f.fileno())
    return size - keep


@dataclass
class Line:
    """One record of a JSONL file and where it lies (for random access and messages)."""
    lineno: int
    offset: int  # byte offset of the line's start
    size: int  # bytes of the line, newline included
    record: object


def parse_json_line(raw: bytes, where: str, *, objects: bool = True):
    """One JSONL line, or the one-line PipelineError every JSONL reader raises for a bad one."""
    try:
        rec = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise PipelineError(f"{where}: malformed JSON line ({raw[:60].decode(errors='replace')!r}...)") from None
    if objects and not isinstance(rec, dict):
        raise PipelineError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    return rec


def jsonl_lines(path: Path, *, tolerate_torn_tail: bool = True, objects: bool = True,
                digest=None) -> Iterator[Line]:
    """The records of a JSONL file with their line numbers and byte offsets; blank lines skipped.
    A malformed *last* line without a newline is a torn write and is skipped (unless
    tolerate_torn_tail=False); a malformed line anywhere else is corruption and raises one line.
    `digest` (a hashlib object) is fed every byte read, so a caller can name exactly what it read."""
    path = Path(path)
    if not path.exists():
        return
    with open(path, "rb") as f:
        offset = 0
        for lineno, raw in enumerate(f, 1):
            if digest is not None:
                digest.update(raw)
            start, offset = offset, offset + len(raw)
            if not raw.strip():
                continue
            try:
                rec = parse_json_line(raw, f"{path}:{lineno}", objects=objects)
            except PipelineError:  # records are objects, so a torn line never parses
                if tolerate_torn_tail and not raw.endswith(b"\n") and not f.read(1):
                    return
                raise
            yield Line(lineno, start, len(raw), rec)


def read_jsonl(path: Path, *, tolerate_torn_tail: bool = True) -> Iterator[dict]:
    """Yield the records of a JSONL file (see jsonl_lines)."""
    for line in jsonl_lines(path, tolerate_torn_tail=tolerate_torn_tail):
        yield line.record


class JsonlWriter:
    """Append-only JSONL. Each record is one line written straight to the file (no buffer) and by
    default fsynced before the call returns, so a kill leaves at most one torn last line, which
    the next open repairs. A write that fails (disk full) is cut back off the file, so later
    writes never land behind half a line, and nothing is left in a buffer to surface later."""

    def __init__(self, path: Path, *, fsync: bool = True):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.repaired_bytes = repair_torn_tail(self.path)
        self._f = open(self.path, "ab", buffering=0)
        self._fsync = fsync

    def write(self, record: dict) -> None:
        line = (json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n").encode()
        start = os.fstat(self._f.fileno()).st_size  # where O_APPEND puts it (tell() can lag a cut)
        try:
            view = memoryview(line)
            while view:  # an unbuffered write may be short; the next one raises (e.g. ENOSPC)
                view = view[self._f.write(view):]
        except BaseException:
            try:
                os.ftruncate(self._f.fileno(), start)
            except OSError:
                pass  # the next open cuts the torn tail instead
            raise
        if self._fsync:
            os.fsync(self._f.fileno())

    def sync(self) -> None:
        """fsync now (for writers opened with fsync=False that sync on a timer instead)."""
        if not self._f.closed:
            os.fsync(self._f.fileno())

    def close(self) -> None:
        if not self._f.closed:
            try:
                os.fsync(self._f.fileno())
            finally:
                self._f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def jsonl_ids(path: Path, key: str = "id") -> list[str]:
    return [rec[key] for rec in read_jsonl(path) if key in rec]


# ----------------------------------------------------------------------------- work to do

def pending_ids(requested: Sequence[str], committed: Iterable[str]) -> list[str]:
    """Work still to do = requested ids - committed ids, in request order, each id once."""
    done = set(committed)
    out, seen = [], set()
    for i in requested:
        if i not in done and i not in seen:
            seen.add(i)
            out.append(i)
    return out


# ----------------------------------------------------------------------------- lock

def _unusable_dir(directory: Path, e: OSError) -> str:
    """Why an output directory cannot be used, in one line (a file in the way, read-only, ...)."""
    if e.errno in (errno.EEXIST, errno.ENOTDIR):
        blocker = next((p for p in (directory, *directory.parents) if p.exists() and not p.is_dir()), directory)
        return f"output directory {directory} cannot be created: {blocker} is a file, not a directory"
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        ro = " (read-only file system)" if e.errno == errno.EROFS else ""
        return f"output directory {directory} is not writable{ro}"
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"output directory {directory}: no space left on device; free space and rerun"
    return f"output directory {directory} cannot be used: {e.strerror or e}"


class DirLock:
    """An exclusive lock on an output directory, so two processes never interleave writes there.
    flock is released by the kernel when the holder dies, so kill -9 leaves no stale lock."""

    def __init__(self, directory: Path, stage: str):
        self.directory = Path(directory)
        self.stage = stage
        self._fd = None

    def __enter__(self):
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise PipelineError(_unusable_dir(self.directory, e)) from None
        path = self.directory / ".lock"
        try:
            self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise PipelineError(_unusable_dir(self.directory, e)) from None
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                holder = os.pread(self._fd, 200, 0).decode(errors="replace").strip()
                os.close(self._fd)
                self._fd = None
                raise PipelineError(
                    f"{self.directory} is in use by another process ({holder or 'unknown'}); "
                    "wait for it or stop it, then rerun") from None
            raise
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"{self.stage} pid {os.getpid()}\n".encode(), 0)
        return self

    def __exit__(self, *exc):
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
