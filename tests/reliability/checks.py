"""What a refused or failed run must leave: one `error:` line and exit 2, no file changed or lost
(snapshots), no complete JSONL record lost."""
from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

from .run import Result
from .views import TMP_PREFIX, walk_files


def assert_one_error_line(res: Result, *needles: str | tuple[str, ...], rc: int = 2) -> str:
    """A user-caused failure: exit `rc`, no traceback, exactly one `error: ...` line, and that line
    names every needle (case-insensitive; a tuple: any one of them). Returns the line."""
    assert res.rc == rc, f"exit {res.rc}, expected {rc}\nstdout: {res.stdout[-2000:]}\nstderr: {res.stderr[-4000:]}"
    assert "Traceback" not in res.stderr, f"a traceback instead of one line:\n{res.stderr[-4000:]}"
    lines = res.error_lines()
    assert len(lines) == 1, f"expected one `error:` line, got {lines}\nstderr: {res.stderr[-4000:]}"
    line = lines[0]
    assert "\n" not in line and len(line) < 1000, line
    for n in needles:
        alts = n if isinstance(n, tuple) else (n,)
        assert any(a.lower() in line.lower() for a in alts), f"{' or '.join(map(repr, alts))} not in {line!r}"
    return line


# ----------------------------------------------------------------------------- snapshots for "nothing lost"


def snapshot(directory: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file (the lock excluded): to prove a failed run changed
    nothing that was already there."""
    directory = Path(directory)
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in walk_files(directory) if p.name != ".lock"}


def assert_unchanged(before: dict[str, str], directory: Path, *, allow_new: Callable[[str], bool] = lambda r: True):
    after = snapshot(directory)
    changed = [k for k in before if after.get(k) != before[k]]
    assert not changed, f"files changed or lost by the failed run: {changed}"
    new = [k for k in after if k not in before and not allow_new(k)]
    assert not new, f"unexpected new files: {new}"


def records_kept(before: dict[str, list[dict]], directory: Path) -> None:
    """Every complete JSONL record there before is still there (a repaired torn tail may go)."""
    for rel, recs in before.items():
        p = Path(directory) / rel
        now = [json.loads(x) for x in p.read_bytes().split(b"\n")[:-1] if x.strip()] if p.exists() else []
        missing = [r for r in recs if r not in now]
        assert not missing, f"{rel}: {len(missing)} records lost, e.g. {str(missing[0])[:200]}"


def jsonl_records(directory: Path) -> dict[str, list[dict]]:
    """The complete (newline-terminated, parseable) records of every JSONL file under `directory`."""
    out = {}
    for p in walk_files(Path(directory)):
        if p.suffix == ".jsonl" and not p.name.startswith(TMP_PREFIX):
            recs = []
            for x in p.read_bytes().split(b"\n")[:-1]:
                try:
                    recs.append(json.loads(x))
                except json.JSONDecodeError:
                    pass
            out[str(p.relative_to(directory))] = recs
    return out
