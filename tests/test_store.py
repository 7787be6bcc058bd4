"""eagle3_train.common.store, directly: atomic writes, the torn-tail repair and strict JSONL reading,
JsonlWriter, pending_ids, DirLock and move_aside (what every stage writes and resumes through)."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from eagle3_train.common import store
from eagle3_train.common.errors import PipelineError
from eagle3_train.common.store import (
    DirLock,
    JsonlWriter,
    atomic_dir_commit,
    atomic_write_bytes,
    atomic_write_json,
    clean_temp_files,
    move_aside,
    pending_ids,
    read_jsonl,
    repair_torn_tail,
)


def names(d: Path) -> list[str]:
    return sorted(p.name for p in Path(d).iterdir())


# ----------------------------------------------------------------------------- atomic writes

def test_atomic_write_creates_parents_leaves_no_temp_and_reads_like_any_file(tmp_path):
    path = tmp_path / "a" / "b" / "x.bin"
    atomic_write_bytes(path, b"one")
    assert path.read_bytes() == b"one" and names(path.parent) == ["x.bin"]
    atomic_write_bytes(path, b"two")
    assert path.read_bytes() == b"two" and names(path.parent) == ["x.bin"]
    mask = os.umask(0)
    os.umask(mask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~mask  # not mkstemp's 0600


def test_a_failed_atomic_write_keeps_the_old_file_and_no_temp(tmp_path, monkeypatch):
    path = tmp_path / "x.json"
    atomic_write_json(path, {"v": 1})

    def fail(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store.os, "fsync", fail)  # the data is written, not yet durable
    with pytest.raises(OSError):
        atomic_write_json(path, {"v": 2})
    monkeypatch.undo()
    assert json.loads(path.read_text()) == {"v": 1}
    assert names(tmp_path) == ["x.json"]


def test_atomic_write_json_is_sorted_and_newline_terminated(tmp_path):
    atomic_write_json(tmp_path / "m.json", {"b": 1, "a": Path("/p")})
    text = (tmp_path / "m.json").read_text()
    assert text.endswith("}\n") and text.index('"a"') < text.index('"b"')
    assert json.loads(text) == {"a": "/p", "b": 1}


def test_atomic_dir_commit_replaces_the_previous_directory(tmp_path):
    final, tmp = tmp_path / "export", tmp_path / ".tmp-export"
    final.mkdir()
    (final / "old.txt").write_text("old")
    tmp.mkdir()
    (tmp / "new.txt").write_text("new")
    atomic_dir_commit(tmp, final)
    assert names(final) == ["new.txt"] and names(tmp_path) == ["export"]


def test_clean_temp_files_removes_only_temp_entries(tmp_path):
    (tmp_path / ".tmp-a.json.x1").write_text("half")
    (tmp_path / ".tmp-dir").mkdir()
    (tmp_path / ".tmp-dir" / "f").write_text("x")
    (tmp_path / "kept.jsonl").write_text("{}\n")
    assert clean_temp_files(tmp_path) == 2
    assert names(tmp_path) == ["kept.jsonl"]
    assert clean_temp_files(tmp_path / "missing") == 0


# ----------------------------------------------------------------------------- torn tails, reading

@pytest.mark.parametrize("content, kept", [
    (b'{"a":1}\n{"a":2}\n', b'{"a":1}\n{"a":2}\n'),      # whole: untouched
    (b'{"a":1}\n{"a":', b'{"a":1}\n'),                   # torn last line cut
    (b'{"a":', b""),                                      # no newline at all: nothing complete
    (b"", b""),
])
def test_repair_torn_tail(tmp_path, content, kept):
    p = tmp_path / "x.jsonl"
    p.write_bytes(content)
    assert repair_torn_tail(p) == len(content) - len(kept)
    assert p.read_bytes() == kept


def test_repair_torn_tail_longer_than_one_scan_block(tmp_path):
    p = tmp_path / "x.jsonl"
    head = b'{"a":1}\n'
    p.write_bytes(head + b'{"pad":"' + b"x" * 200_000)
    assert repair_torn_tail(p) == 200_008
    assert p.read_bytes() == head
    assert repair_torn_tail(tmp_path / "missing.jsonl") == 0


def test_read_jsonl_skips_a_torn_tail_and_blank_lines(tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_bytes(b'{"id":"a"}\n\n{"id":"b"}\n{"id":"c", "x"')
    assert [r["id"] for r in read_jsonl(p)] == ["a", "b"]
    with pytest.raises(PipelineError, match=r"x\.jsonl:4: malformed JSON line"):
        list(read_jsonl(p, tolerate_torn_tail=False))
    assert list(read_jsonl(tmp_path / "missing.jsonl")) == []


def test_read_jsonl_refuses_corruption_before_the_last_line(tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_bytes(b'{"id":"a"}\n{"id":\n{"id":"c"}\n')
    with pytest.raises(PipelineError, match=r"x\.jsonl:2: malformed JSON line") as e:
        list(read_jsonl(p))
    assert "\n" not in str(e.value)
    p.write_bytes(b'{"id":"a"}\n[1, 2]\n')
    with pytest.raises(PipelineError, match=r"x\.jsonl:2: expected a JSON object, got list"):
        list(read_jsonl(p))
    # a malformed last line that *is* newline-terminated was written whole: corruption, not a tear
    p.write_bytes(b'{"id":"a"}\n{"id":\n')
    with pytest.raises(PipelineError, match=r":2: malformed"):
        list(read_jsonl(p))


# ----------------------------------------------------------------------------- JsonlWriter

def test_jsonl_writer_repairs_on_open_then_appends(tmp_path):
    p = tmp_path / "sub" / "x.jsonl"
    p.parent.mkdir()
    p.write_bytes(b'{"id":"a"}\n{"id":"b","te')
    with JsonlWriter(p) as w:
        assert w.repaired_bytes == len(b'{"id":"b","te')
        w.write({"id": "b", "text": "ünï"})
        w.write({"id": "c"})
    assert [r["id"] for r in read_jsonl(p, tolerate_torn_tail=False)] == ["a", "b", "c"]
    assert "ünï" in p.read_text()  # UTF-8, not \u escapes
    assert w._f.closed


def test_jsonl_writer_fsyncs_each_record_unless_told_not_to(tmp_path, monkeypatch):
    calls = []
    real = os.fsync
    monkeypatch.setattr(store.os, "fsync", lambda fd: (calls.append(fd), real(fd)))
    with JsonlWriter(tmp_path / "a.jsonl") as w:
        for i in range(3):
            w.write({"i": i})
            assert len(calls) == i + 1  # durable before write() returns
    calls.clear()
    w = JsonlWriter(tmp_path / "b.jsonl", fsync=False)
    w.write({"i": 0})
    assert calls == []
    w.sync()
    assert len(calls) == 1
    w.close()


class _ShortThenFull:
    """A file whose next write stores half the bytes, then the disk is full."""

    def __init__(self, f):
        self.f, self.calls = f, 0

    def write(self, view):
        self.calls += 1
        if self.calls == 1:
            return self.f.write(view[: len(view) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    def __getattr__(self, name):
        return getattr(self.f, name)


def test_jsonl_writer_cuts_back_a_record_that_did_not_fit(tmp_path):
    p = tmp_path / "x.jsonl"
    w = JsonlWriter(p)
    w.write({"id": "a"})
    real = w._f
    w._f = _ShortThenFull(real)
    with pytest.raises(OSError):
        w.write({"id": "b", "pad": "x" * 100})
    assert p.read_bytes() == b'{"id":"a"}\n'  # no half line left for the next write to land behind
    w._f = real
    w.write({"id": "c"})
    w.close()
    assert [r["id"] for r in read_jsonl(p, tolerate_torn_tail=False)] == ["a", "c"]


# ----------------------------------------------------------------------------- work to do

def test_pending_ids_keeps_request_order_each_id_once():
    assert pending_ids(["c", "a", "b", "a", "d"], iter(["b"])) == ["c", "a", "d"]
    assert pending_ids(["a", "b"], ["a", "b", "z"]) == []
    assert pending_ids([], []) == []


# ----------------------------------------------------------------------------- DirLock

def test_dir_lock_refuses_a_second_holder_naming_the_first(tmp_path):
    out = tmp_path / "out"
    with DirLock(out, "02_extract"):
        assert (out / ".lock").read_text() == f"02_extract pid {os.getpid()}\n"
        with pytest.raises(PipelineError, match=rf"in use by another process \(02_extract pid {os.getpid()}\)"):
            with DirLock(out, "04_train"):
                pass
    with DirLock(out, "04_train"):  # released on exit
        assert (out / ".lock").read_text().startswith("04_train pid ")


_HOLD = "import sys, time; from eagle3_train.common.store import DirLock; DirLock(sys.argv[1], 'x').__enter__(); " \
        "print('locked', flush=True); time.sleep(600)"


def test_a_killed_holder_leaves_no_stale_lock(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "locked"
        with pytest.raises(PipelineError, match="in use"):
            DirLock(out, "y").__enter__()
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        with DirLock(out, "y"):
            pass
    finally:
        proc.kill()
        proc.wait()


def test_dir_lock_where_a_file_is_says_so_in_one_line(tmp_path):
    (tmp_path / "f").write_text("mine")
    with pytest.raises(PipelineError, match=r"cannot be created: .*f is a file, not a directory"):
        DirLock(tmp_path / "f" / "out", "s").__enter__()
    assert (tmp_path / "f").read_text() == "mine"


# ----------------------------------------------------------------------------- move_aside

def test_move_aside_moves_everything_but_the_lock_and_earlier_replacements(tmp_path, monkeypatch):
    for n in ("manifest.json", "data.jsonl", "a.txt"):
        (tmp_path / n).write_text(n)
    (tmp_path / ".lock").write_text("")
    (tmp_path / "replaced-old").mkdir()
    order = []
    real = os.replace
    monkeypatch.setattr(store.os, "replace", lambda a, b: (order.append(Path(a).name), real(a, b)))
    dest = move_aside(tmp_path)
    assert dest.parent == tmp_path and dest.name.startswith("replaced-")
    assert names(dest) == ["a.txt", "data.jsonl", "manifest.json"]
    assert (dest / "data.jsonl").read_text() == "data.jsonl"  # moved, not deleted
    assert order[0] == "manifest.json"  # from the first move on, the directory claims nothing
    assert names(tmp_path) == sorted([".lock", "replaced-old", dest.name])


def test_move_aside_named_entries_twice_in_a_second_and_nothing_to_move(tmp_path):
    (tmp_path / "x").write_text("1")
    (tmp_path / "y").write_text("keep")
    first = move_aside(tmp_path, ["x", "missing"])
    assert names(first) == ["x"] and (tmp_path / "y").exists()
    (tmp_path / "x").write_text("2")
    second = move_aside(tmp_path, ["x"])
    assert second != first and (second / "x").read_text() == "2" and (first / "x").read_text() == "1"
    assert move_aside(tmp_path, ["x"]) is None
    assert move_aside(tmp_path / "absent") is None
