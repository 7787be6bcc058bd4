"""Where a stage writes can fail too: every stage, given an output directory it cannot use (a
read-only mount, a file in the way), a full disk, or a directory another process is writing,
stops with one `error: ...` line and exit 2, loses nothing it had written, and (disk full)
resumes to the same output once there is room.

Root ignores permission bits, so "not writable" is a read-only bind mount (EROFS) and a file where
the directory should be; "disk full" is a tmpfs of a few hundred KB (a real ENOSPC). Both need
mount (root or CAP_SYS_ADMIN); where it is refused those two tests skip and say why."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
from helpers_generate import FaultServer, write_prompts
from reliability import (  # noqa: F401
    VIEWS,
    argv01b,
    assert_one_error_line,
    chain,
    diff_views,
    fault_server,
    jsonl_records,
    lock_held,
    read_only,
    records_kept,
    resize_disk,
    run_inprocess,
    small_disk,
    snapshot,
    stage_cmd,
    stage_env,
    temp_files,
)

pytestmark = pytest.mark.e2e  # stage processes, kill -9, real files: the slow part of the suite

STAGES = ["01b", "01c", "02", "03", "04", "05"]
SCRIPTS = {"01b": "01b_generate_synthetic", "01c": "01c_tokenize", "02": "02_extract_hidden_states",
           "03": "03_build_vocab_mapping", "04": "04_train", "05": "05_evaluate"}


@pytest.fixture(scope="module")
def argv_for(chain):
    """stage -> (out -> the stage's argv), with inputs from the tiny chain."""
    return {
        "01b": chain.argv01b,
        "01c": chain.argv01c,
        "02": lambda out: [*chain.argv02(out), "--force"],  # --force: past the disk estimate, to a real ENOSPC
        "03": chain.argv03,
        "04": chain.argv04,
        "05": chain.argv05,
    }


@pytest.fixture(scope="module")
def reference(chain):
    """stage -> an uninterrupted output of the same command (the chain's)."""
    return lambda stage: {"01b": chain.gen, "01c": chain.tokenized, "02": chain.hs, "03": chain.vocab,
                          "04": chain.run, "05": chain.eval}[stage]


# ----------------------------------------------------------------------------- not writable

@pytest.mark.parametrize("stage", STAGES)
def test_output_on_a_read_only_mount(stage, argv_for, tmp_path, capfd):
    with read_only(tmp_path / "ro") as ro:
        res = run_inprocess(SCRIPTS[stage], argv_for[stage](ro / "out"), capfd)
        assert_one_error_line(res, str(ro / "out"), ("not writable", "read-only"))
        assert not (ro / "out").exists()


@pytest.mark.parametrize("stage", STAGES)
def test_output_where_a_file_is(stage, argv_for, tmp_path, capfd):
    blocker = tmp_path / "results"
    blocker.write_text("a file the user keeps here\n")
    for out in (blocker, blocker / "out"):
        res = run_inprocess(SCRIPTS[stage], argv_for[stage](out), capfd)
        assert_one_error_line(res, str(blocker), "not a directory")
    assert blocker.read_text() == "a file the user keeps here\n"


# ----------------------------------------------------------------------------- another process

@pytest.mark.parametrize("stage", STAGES)
def test_a_second_process_on_the_same_output_is_refused(stage, argv_for, tmp_path, capfd):
    out = tmp_path / "out"
    with lock_held(out, f"{stage}-first"):
        before = snapshot(out)
        res = run_inprocess(SCRIPTS[stage], argv_for[stage](out), capfd)
        assert_one_error_line(res, str(out), "in use by another process", f"{stage}-first")
        assert snapshot(out) == before, "the refused run wrote into a directory another process owns"


def test_two_01b_processes_one_is_refused_and_the_other_completes(tmp_path, capfd):
    """Two real stage processes on one directory: the second is refused while the first runs,
    which then finishes with every id once."""
    prompts = write_prompts(tmp_path / "p.jsonl", [f"q {i}" for i in range(30)])
    out = tmp_path / "gen"
    with FaultServer(tmp_path, "--delay", "0.1") as fs:
        first = subprocess.Popen(stage_cmd(SCRIPTS["01b"], argv01b(prompts, out, fs.url, "--concurrency", "1")),
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=stage_env())
        try:
            deadline = time.monotonic() + 120
            while not (out / "raw_responses.jsonl").exists() or not (out / "raw_responses.jsonl").stat().st_size:
                assert first.poll() is None and time.monotonic() < deadline, first.stderr.read() if first.stderr else ""
                time.sleep(0.05)
            res = run_inprocess(SCRIPTS["01b"], argv01b(prompts, out, fs.url), capfd)
            assert_one_error_line(res, "in use by another process", "01b_generate_synthetic pid")
            _, err = first.communicate(timeout=180)
        finally:
            if first.poll() is None:
                first.kill()
    assert first.returncode == 0, err
    ids = [json.loads(x)["id"] for x in (out / "raw_responses.jsonl").read_text().splitlines()]
    assert sorted(ids) == [f"q{i:03d}" for i in range(30)]


# ----------------------------------------------------------------------------- disk full

# tmpfs sizes that cut each stage's first run short (its output is 40 KB .. 12 MB)
DISK = {"01b": "24k", "01c": "8k", "02": "512k", "03": "40k", "04": "2m", "05": "24k"}


def committed_files(out: Path) -> dict[str, str]:
    """Non-JSONL outputs (JSONL is compared record by record): path -> sha256."""
    return {k: v for k, v in snapshot(out).items()
            if not k.endswith(".jsonl") and k != "progress.log" and not any(
                part.startswith(".tmp-") for part in Path(k).parts)}


@pytest.mark.parametrize("stage", STAGES)
def test_disk_full_is_one_line_keeps_what_was_written_and_resumes(stage, argv_for, reference, tmp_path, capfd):
    with small_disk(tmp_path / "disk", DISK[stage]) as disk:
        out = disk / "out"
        argv = argv_for[stage](out)
        res = run_inprocess(SCRIPTS[stage], argv, capfd)
        assert_one_error_line(res, "no space left")
        assert not (out / "manifest.json").exists()
        # A second try on the still-full disk: refused the same way, and what the first run had
        # written (records, committed files) is all still there, unchanged.
        records, files = jsonl_records(out), committed_files(out)
        res = run_inprocess(SCRIPTS[stage], argv, capfd)
        assert_one_error_line(res, "no space left")
        records_kept(records, out)
        now = committed_files(out)
        changed = [k for k in files if now.get(k) != files[k]]
        assert not changed, f"files changed or lost on a full disk: {changed}"
        # Room again: the same command finishes, equal to an uninterrupted run.
        resize_disk(disk, "64m")
        res = run_inprocess(SCRIPTS[stage], argv, capfd)
        assert res.rc == 0, res.stderr[-3000:]
        ref = VIEWS[stage](reference(stage))
        got = VIEWS[stage](out)
        assert got == ref, "; ".join(diff_views(ref, got))
        assert not temp_files(out)


def test_jsonl_writer_on_a_full_disk_leaves_whole_lines_only(tmp_path):
    """store.JsonlWriter (what every stage appends through): a record that does not fit is cut back
    off, so the file stays whole lines and a later append (once there is room) is not glued to
    half a record."""
    from eagle3_train.common.store import JsonlWriter, read_jsonl

    with small_disk(tmp_path / "disk", "16k") as disk:
        path = disk / "x.jsonl"
        w = JsonlWriter(path, fsync=False)
        written, failed = 0, 0
        for i in range(200):
            try:
                w.write({"id": f"r{i}", "pad": "x" * 300})
                written += 1
            except OSError:
                failed += 1
        assert written and failed, "the disk never filled"
        assert path.read_bytes().endswith(b"\n")
        resize_disk(disk, "1m")
        w.write({"id": "after", "pad": ""})
        w.close()
        ids = [r["id"] for r in read_jsonl(path, tolerate_torn_tail=False)]
        assert ids == [f"r{i}" for i in range(written)] + ["after"]
