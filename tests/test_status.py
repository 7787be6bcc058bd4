"""status.py: every stage's state in a work directory (done / running / interrupted / failed / not
started) and the next command. Unit tests on synthetic directories written with the stages' own
writers (write_manifest, DirLock, Progress); one e2e test on the tiny chain's real outputs with a
real 04 process, alive and then killed -9."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from eagle3_train.common.manifest import write_manifest
from eagle3_train.common.progress import Progress
from eagle3_train.common.store import DirLock, atomic_write_json
from eagle3_train.status import cli, probe
from eagle3_train.status.state import DONE, FAILED, INTERRUPTED, NOT_STARTED, RUNNING, stage_state
from helpers import REPO, script_path
from reliability import chain, fault_server  # noqa: F401  (fixtures, taken by name)

SCRIPT = script_path("status")
ORDER = list(probe.KEYS)  # 01 (the prompt split) first where the tree has it, then 01b ... 05
ID = {k: stage_id for k, stage_id, _ in probe.STAGES}


def rows(work: Path) -> dict:
    return {r["stage"]: r for r in cli.status(work)["stages"]}


def one(directory: Path) -> dict:
    """The state of the stage one synthetic directory holds, through probe() and stage_state()."""
    facts = probe.probe(directory)
    assert facts is not None, f"{directory} not recognised as a stage directory"
    return stage_state(facts["key"], facts, time.time())


def progress(directory: Path, stage: str, total: int, done: int, *, note: str | None = None, **extra) -> None:
    """progress.log lines as the stages write them (common/progress.py)."""
    p = Progress(stage, total, log_path=directory / "progress.log", every_s=0, disable=True, unit="req")
    p.update(done, **extra)
    if note:
        p.close(note)


def dead_lock(directory: Path, stage: str) -> None:
    """A .lock whose holder is gone: taken and released (a kill -9 releases it the same way)."""
    with DirLock(directory, stage):
        pass


# ----------------------------------------------------------------------------- 01

@pytest.mark.skipif("01" not in probe.KEYS, reason="this tree has no 01_split_prompts")
def test_01_done_and_its_files_feed_01b_and_05(tmp_path):
    w = tmp_path / "w"
    dead_lock(w / "p", ID["01"])
    write_manifest(w / "p", ID["01"], config={}, counts={"prompts": 1000, "train": 950, "heldout": 50})
    assert one(w / "p")["line"] == "1,000 prompts: 950 to train on, 50 held out"
    nxt = cli.status(w)["next"]
    assert nxt["stage"] == "01b" and f"--input {w}/p/train.jsonl --output-dir {w}/gen " in nxt["command"]
    draft_partial(w / "d", [8], 8)
    write_manifest(w / "d", ID["04"], config={}, counts={"steps": 8})
    assert f"--prompts {w}/p/heldout.jsonl" in cli.status(w)["next"]["command"]


def test_prompt_files_alone_are_no_stage(tmp_path):
    """The demo's and a user's own train.jsonl / heldout.jsonl, without a split's manifest or lock."""
    (tmp_path / "prompts").mkdir()
    (tmp_path / "prompts" / "train.jsonl").write_text('{"id": "a"}\n')
    assert probe.probe(tmp_path / "prompts") is None


# ----------------------------------------------------------------------------- 01b

def gen_partial(d: Path, answered: int, total: int) -> Path:
    dead_lock(d, ID["01b"])
    (d / "raw_responses.jsonl").write_text("".join(json.dumps({"id": f"p{i}"}) + "\n" for i in range(answered)))
    (d / "errors.jsonl").write_text("")
    progress(d, ID["01b"], total, answered)
    return d


def test_01b_done_shows_answers_failed_tokens(tmp_path):
    d = tmp_path / "gen"
    gen_partial(d, 3, 3)
    write_manifest(d, ID["01b"], config={}, counts={"answered": 998, "failed": 2, "generated_tokens": 2_500_000})
    r = one(d)
    assert r["state"] == DONE
    assert r["line"].startswith("998 answers, 2 failed, 2.50M generated tokens")
    assert "retry the failed ids" in r["line"]


def test_01b_killed_says_how_many_ids_answered_of_how_many(tmp_path):
    r = one(gen_partial(tmp_path / "gen", 312, 1000))
    assert r["state"] == INTERRUPTED
    assert r["line"] == "312 of 1,000 ids answered; rerun the same command to answer the rest"


def test_01b_running_has_pid_progress_rate(tmp_path):
    d = tmp_path / "gen"
    d.mkdir()
    with DirLock(d, ID["01b"]):
        progress(d, ID["01b"], 1000, 312)
        r = one(d)
    assert r["state"] == RUNNING and r["pid"] == os.getpid()
    assert f"pid {os.getpid()}, 312/1,000 req (31.2%)" in r["line"]
    assert " req/s" in r["line"] and "progress.log" in r["line"]
    assert one(d)["state"] == INTERRUPTED  # the same files, the holder gone


def test_01b_failed_names_the_last_error_line(tmp_path):
    d = gen_partial(tmp_path / "gen", 5, 100)
    progress(d, ID["01b"], 100, 0, note="failed")
    (d / "gen.log").write_text("01b: 100 prompts requested\nerror: cannot reach http://gpu1:8000/v1 "
                               "(connection refused); start the server or fix --base-url\n")
    r = one(d)
    assert r["state"] == FAILED
    assert r["line"].startswith("error: cannot reach http://gpu1:8000/v1")
    assert "gen.log" in r["line"]


def test_an_error_line_older_than_the_output_is_an_earlier_runs(tmp_path):
    d = gen_partial(tmp_path / "gen", 5, 100)
    log = d / "gen.log"
    log.write_text("error: an earlier run's mistake\n")
    old = time.time() - 3600
    os.utime(log, (old, old))
    assert one(d)["state"] == INTERRUPTED


def test_ctrl_c_is_interrupted_not_failed(tmp_path):
    d = gen_partial(tmp_path / "gen", 5, 100)
    progress(d, ID["01b"], 100, 0, note="stopped (KeyboardInterrupt)")
    r = one(d)
    assert r["state"] == INTERRUPTED and "KeyboardInterrupt" in r["line"]


# ----------------------------------------------------------------------------- 01c

def test_01c_done_and_interrupted(tmp_path):
    d = tmp_path / "tokenized"
    dead_lock(d, ID["01c"])
    (d / "data.jsonl").write_text('{"id": "a"}\n')
    progress(d, "tokenize", 40, 10)
    r = one(d)
    assert r["state"] == INTERRUPTED and r["line"] == "stopped at 10/40 req; rerun the same command"
    write_manifest(d, ID["01c"], config={}, counts={"samples": 40, "tokens": 12000, "supervised_tokens": 9000,
                                                    "dropped_length": 2, "dropped_empty_answer": 1})
    assert one(d)["line"] == "40 samples, 12,000 tokens (9,000 supervised), 3 dropped"


# ----------------------------------------------------------------------------- 02

def hidden_partial(d: Path, planned: int, shards: list[list[str]]) -> Path:
    dead_lock(d, ID["02"])
    atomic_write_json(d / "plan.json", {"samples": planned, "shards": [], "version": 1})
    with open(d / "index.jsonl", "w") as f:
        for k, ids in enumerate(shards):
            f.write(json.dumps({"shard": f"shard-{k:05d}.safetensors", "k": k, "ids": ids, "bytes": 1_000_000}) + "\n")
        f.write('{"shard": "shard-0000')  # torn: no shard
    return d


def test_02_interrupted_counts_committed_shards_and_samples(tmp_path):
    r = one(hidden_partial(tmp_path / "hidden", 10, [["a", "b", "c"], ["d", "e", "f"]]))
    assert r["state"] == INTERRUPTED
    assert r["line"] == "6 of 10 samples in 2 committed shards (2.00 MB); rerun the same command to extract the rest"


def test_02_done_shows_samples_shards_size(tmp_path):
    d = hidden_partial(tmp_path / "hidden", 10, [["a"]])
    write_manifest(d, ID["02"], config={}, counts={"samples": 10, "shards": 2, "bytes": 41_300_000_000},
                   storage={"format": "fp8-topk"})
    assert one(d) | {"path": None} == {"stage": "02", "state": DONE, "path": None, "pid": None,
                                       "line": "10 samples in 2 shards, 41.30 GB (fp8-topk)"}


def test_02_running_while_locked(tmp_path):
    d = tmp_path / "hidden"
    with DirLock(d, ID["02"]):
        atomic_write_json(d / "plan.json", {"samples": 10})
        progress(d, "02 extract", 10, 4)
        r = one(d)
    assert r["state"] == RUNNING and "4/10" in r["line"]


def test_02_captured_during_01b_runs_while_its_01b_does(tmp_path):
    """01b --capture-hidden-states fills gen/hidden under 01b's own lock: 02 is running with it."""
    gen = tmp_path / "gen"
    with DirLock(gen, ID["01b"]):
        progress(gen, ID["01b"], 100, 40)
        (gen / "hidden").mkdir()
        atomic_write_json(gen / "hidden" / "plan.json", {"samples": 100})
        got = rows(tmp_path)
    assert got["01b"]["state"] == RUNNING and got["02"]["state"] == RUNNING
    assert got["02"]["pid"] == os.getpid() and f"captured by 01b in {gen}" in got["02"]["line"]
    assert rows(tmp_path)["02"]["state"] == INTERRUPTED


# ----------------------------------------------------------------------------- 03

def test_03_done_shows_vocab_and_coverage(tmp_path):
    d = tmp_path / "vocab"
    dead_lock(d, ID["03"])
    write_manifest(d, ID["03"], config={}, draft_vocab_size=32000, coverage={"overall": 0.9712, "heldout": 0.9650})
    assert one(d)["line"] == "draft vocab 32,000, covers 97.12% of supervised tokens (96.50% held-out)"


def test_03_interrupted_while_counting(tmp_path):
    d = tmp_path / "vocab"
    dead_lock(d, ID["03"])
    progress(d, "03 count", 1000, 250)
    assert one(d)["state"] == INTERRUPTED


# ----------------------------------------------------------------------------- 04

def draft_partial(d: Path, steps: list[int], total: int, *, torn: int | None = None, locked: bool = False) -> Path:
    if not locked:  # else the caller holds it
        dead_lock(d, ID["04"])
    for s in steps:
        (d / "checkpoints" / f"step-{s:07d}").mkdir(parents=True)
        (d / "checkpoints" / f"step-{s:07d}" / "COMPLETE").write_text(f"step {s}\n")
    if torn:  # a checkpoint being written: not valid without COMPLETE
        (d / "checkpoints" / f"step-{torn:07d}").mkdir(parents=True)
    atomic_write_json(d / "schedule.json", {"total_steps": total})
    with open(d / "metrics.jsonl", "w") as f:
        for s, a in ((200, 1.8), (400, 2.1)):
            f.write(json.dumps({"kind": "val", "step": s, "acceptance_length": a}) + "\n")
    return d


def test_04_killed_says_the_last_checkpoint_of_the_total(tmp_path):
    r = one(draft_partial(tmp_path / "draft", [200, 400], 1000, torn=600))
    assert r["state"] == INTERRUPTED
    assert r["line"] == ("last checkpoint step-400 of 1,000; rerun the same command to resume from it "
                         "(best validation AL so far 2.100)")


def test_04_killed_before_any_checkpoint(tmp_path):
    r = one(draft_partial(tmp_path / "draft", [], 1000, torn=200))
    assert r["line"] == "no checkpoint yet (1,000 steps planned): a rerun starts at step 0"


def test_04_done_shows_steps_and_best_al(tmp_path):
    d = draft_partial(tmp_path / "draft", [400], 1000)
    write_manifest(d, ID["04"], config={}, counts={"steps": 1000, "exported_step": 800},
                   best={"step": 800, "acceptance_length": 2.934})
    assert one(d)["line"] == "1,000 steps, best validation AL 2.934 at step 800, exported step 800"


def test_04_running_shows_the_last_checkpoint(tmp_path):
    d = tmp_path / "draft"
    with DirLock(d, ID["04"]):
        draft_partial(d, [200, 400], 1000, locked=True)
        progress(d, ID["04"], 1000, 450, loss="1.2345")
        r = one(d)
    assert r["state"] == RUNNING
    assert "450/1,000" in r["line"] and "last checkpoint step-400, best validation AL so far 2.100" in r["line"]


def test_04_follow_timeout_is_a_stop_to_rerun(tmp_path):
    d = draft_partial(tmp_path / "draft", [200], 1000)
    atomic_write_json(d / "stopped.json", {"stopped": "follow-timeout", "exit_code": 75, "step": 200,
                                           "message": "no new shard; checkpointed at step 200 of 1000: rerun to go on"})
    r = one(d)
    assert r["state"] == INTERRUPTED and r["line"].startswith("no new shard; checkpointed at step 200") \
        and "exit 75" in r["line"]


def test_04_failed_with_a_traceback_in_a_tee_log(tmp_path):
    d = draft_partial(tmp_path / "draft", [200], 1000)
    (d / "train.log").write_text("step 201\nTraceback (most recent call last):\n  File \"x.py\", line 1\n"
                                 "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n")
    r = one(d)
    assert r["state"] == FAILED and r["line"].startswith("torch.OutOfMemoryError: CUDA out of memory")


# ----------------------------------------------------------------------------- 05

def test_05_done_shows_offline_and_vllm_al_and_recommended_k(tmp_path):
    d = tmp_path / "eval"
    dead_lock(d, ID["05"])
    atomic_write_json(d / "report.json", {"k": 3, "offline": {"acceptance_length": 2.91},
                                          "online": {"arms": {"eagle3": {"spec": {"acceptance_length": 2.80}}}},
                                          "k_sweep": {"recommended_k": 5}})
    write_manifest(d, ID["05"], config={}, counts={"offline_samples": 16, "arms": 3})
    assert one(d)["line"] == "K 3, offline AL 2.910, vLLM AL 2.800, recommended K 5"


def test_05_interrupted_lists_the_parts_kept(tmp_path):
    d = tmp_path / "eval"
    dead_lock(d, ID["05"])
    atomic_write_json(d / "offline.json", {"acceptance_length": 2.9})
    (d / "arms").mkdir()
    atomic_write_json(d / "arms" / "eagle3.json", {})
    assert one(d)["line"] == "finished: offline, arm eagle3; rerun the same command to do the rest"


# ----------------------------------------------------------------------------- the whole directory

def test_stages_are_found_by_content_in_pipeline_order_and_the_next_command(tmp_path):
    """Directory names mean nothing: 02 in 'x', 03 in 'y/z'; the pilot's own stages are left out."""
    w = tmp_path / "w"
    gen_partial(w / "gen", 3, 3)
    write_manifest(w / "gen", ID["01b"], config={"target": "/m/kimi"}, counts={"answered": 3})
    write_manifest(w / "gen" / "tokenized", ID["01c"], config={}, counts={"samples": 3},
                   tokenizer={"name_or_path": "/m/kimi"})
    hidden_partial(w / "x", 3, [["a", "b"]])
    write_manifest(w / "x", ID["02"], config={}, counts={"samples": 3}, target={"name_or_path": "/m/kimi"})
    draft_partial(w / "pilot" / "draft", [2], 20)
    atomic_write_json(w / "pilot" / "pilot_report.json", {})
    report = cli.status(w)
    got = [(r["stage"], r["state"], r["path"] and Path(r["path"]).relative_to(w).as_posix())
           for r in report["stages"]]
    assert got == ([("01", NOT_STARTED, None)] if "01" in ORDER else []) + [
        ("01b", DONE, "gen"), ("01c", DONE, "gen/tokenized"), ("02", DONE, "x"),
        ("03", NOT_STARTED, None), ("04", NOT_STARTED, None), ("05", NOT_STARTED, None)]
    assert any("pilot" in n for n in report["notes"])
    nxt = report["next"]
    assert nxt["stage"] == "03"
    assert nxt["command"] == (f"uv run eagle3-train/03_build_vocab_mapping.py --data {w}/gen/tokenized "
                              f"--target /m/kimi --output-dir {w}/vocab --draft-vocab-size 32000")


def test_next_is_the_rerun_of_an_interrupted_stage_and_what_follows_a_running_one(tmp_path):
    w = tmp_path / "runs" / "demo"  # the demo's numbered layout
    for key, name in (("02", "02"), ("03", "03")):
        dead_lock(w / name, ID[key])
        write_manifest(w / name, ID[key], config={}, target={"name_or_path": "/m/t"})
    draft_partial(w / "04", [3], 9)
    nxt = cli.status(w)["next"]
    assert nxt["stage"] == "04" and "interrupted" in nxt["why"]
    assert nxt["command"] == (f"uv run eagle3-train/04_train.py --hidden-states {w}/02 --vocab-mapping {w}/03 "
                              f"--target /m/t --output-dir {w}/04")
    with DirLock(w / "04", ID["04"]):
        nxt = cli.status(w)["next"]
    assert nxt["stage"] == "05" and f"04 is running (pid {os.getpid()})" in nxt["why"]
    assert nxt["command"].startswith(f"uv run eagle3-train/05_evaluate.py --draft {w}/04/export --target /m/t "
                                     f"--store {w}/02 --output-dir {w}/05")


def test_an_empty_work_dir_says_start_with_01b(tmp_path):
    report = cli.status(tmp_path)
    assert all(r["state"] == NOT_STARTED for r in report["stages"])
    assert report["next"]["stage"] == ORDER[0] and "--input PROMPTS" in report["next"]["command"]


def test_file_names_match_the_stages(tmp_path):
    """probe.py keeps the stages' file names itself (their modules import torch): the same names."""
    from eagle3_train.common import hidden_store as hs
    from eagle3_train.evaluate import report
    from eagle3_train.generate import config as gen
    from eagle3_train.tokenize import dataset
    from eagle3_train.train import checkpoint
    from eagle3_train.train import config as train
    from eagle3_train.vocab import mapping

    assert (probe.RAW, probe.ERRORS) == (gen.RAW, gen.ERRORS)
    assert probe.DATA == dataset.DATA
    assert (probe.PLAN, probe.INDEX, probe.HEADER) == (hs.PLAN, hs.INDEX, hs.HEADER)
    assert (probe.MAPPING, probe.COVERAGE, probe.FREQ) == (mapping.MAPPING, mapping.COVERAGE_JSON, mapping.FREQ)
    assert (probe.CKPT_DIR, probe.METRICS, probe.SCHEDULE, probe.STOPPED) == \
        (train.CKPT_DIR, train.METRICS, train.SCHEDULE, train.STOPPED)
    assert probe.COMPLETE == checkpoint.COMPLETE and probe.REPORT == report.REPORT_JSON
    if "01" in probe.KEYS:
        from eagle3_train.split_prompts import config as split

        assert (probe.SPLIT_TRAIN, probe.SPLIT_HELDOUT) == (split.TRAIN_FILE, split.HELDOUT_FILE)


# ----------------------------------------------------------------------------- the command line

def run_cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True,
                          cwd=REPO, timeout=60)


def test_cli_missing_or_file_work_is_one_error_line_exit_2(tmp_path):
    for bad in (tmp_path / "nope", tmp_path / "f"):
        if bad.name == "f":
            bad.write_text("")
        res = run_cli(bad)
        assert res.returncode == 2 and res.stdout == ""
        assert res.stderr.count("\n") == 1 and res.stderr.startswith(f"error: WORK {bad} ")


def test_cli_prints_a_line_per_stage_json_too_writes_nothing_imports_no_torch(tmp_path):
    w = tmp_path / "w"
    draft_partial(w / "draft", [4], 8)
    before = sorted((str(p), p.stat().st_mtime_ns) for p in w.rglob("*"))
    res = run_cli(w)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert [ln.split()[0] for ln in lines[:len(ORDER)]] == ORDER
    i = ORDER.index("04")
    assert lines[i].split()[1] == INTERRUPTED and "last checkpoint step-4 of 8" in lines[i]
    assert lines[len(ORDER)].startswith("next: 04 was interrupted")
    data = json.loads(run_cli(w, "--json").stdout)
    assert [r["state"] for r in data["stages"]] == [INTERRUPTED if k == "04" else NOT_STARTED for k in ORDER]
    assert sorted((str(p), p.stat().st_mtime_ns) for p in w.rglob("*")) == before
    code = ("import sys; from eagle3_train.status import cli; cli.main([sys.argv[1]]); "
            "print('heavy:', sorted(m for m in ('torch', 'transformers', 'numpy', 'tqdm') if m in sys.modules))")
    res = subprocess.run([sys.executable, "-c", code, str(w)], capture_output=True, text=True, timeout=60)
    assert res.stdout.splitlines()[-1] == "heavy: []"


# ----------------------------------------------------------------------------- end to end

@pytest.mark.e2e
def test_e2e_a_real_04_running_then_killed(chain, tmp_path):  # noqa: F811
    """The tiny chain's real 01b/01c/02/03 outputs (linked under one WORK, named as nothing in
    particular), then a real 04 process: running while it holds its lock, interrupted after kill -9."""
    w = tmp_path / "work"
    w.mkdir()
    for name, src in (("gen", chain.gen), ("tokenized", chain.tokenized), ("hs", chain.hs), ("vocab", chain.vocab)):
        (w / name).symlink_to(src)
    states = {k: r["state"] for k, r in rows(w).items() if k != "01"}  # the chain writes its prompts itself
    assert states == {"01b": DONE, "01c": DONE, "02": DONE, "03": DONE, "04": NOT_STARTED, "05": NOT_STARTED}
    nxt = cli.status(w)["next"]
    assert nxt["stage"] == "04"
    assert f"--hidden-states {w}/hs --vocab-mapping {w}/vocab --target {chain.target}" in nxt["command"]

    out = w / "draft"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    argv = chain.argv04(out, epochs=500, save_every=1)  # runs until killed; a checkpoint after step 1
    proc = subprocess.Popen([sys.executable, str(script_path("04_train")), *argv], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 600  # a hang guard: under load 04 takes minutes to its first step
        while not probe.partial_04(out)["checkpoints"] and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert proc.poll() is None, f"04 ended before the test saw it run: {proc.stderr.read()[-2000:]}"
        res = run_cli(w, "--json")  # the real command, beside the live stage
        running = {r["stage"]: r for r in json.loads(res.stdout)["stages"]}["04"]
        assert proc.poll() is None, "status disturbed the running stage"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert running["state"] == RUNNING and running["pid"] == proc.pid
    assert f"pid {proc.pid}, " in running["line"] and "last checkpoint step-" in running["line"]

    assert proc.returncode == -signal.SIGKILL
    r = rows(w)
    last = probe.partial_04(out)["checkpoints"][-1]
    total = json.loads((out / "schedule.json").read_text())["total_steps"]
    assert r["04"]["state"] == INTERRUPTED
    assert r["04"]["line"].startswith(f"last checkpoint step-{last} of {total:,}; rerun the same command")
    assert r["05"]["state"] == NOT_STARTED and r["03"]["state"] == DONE
    nxt = cli.status(w)["next"]
    assert nxt["stage"] == "04" and nxt["command"].endswith(f"--output-dir {out}")
