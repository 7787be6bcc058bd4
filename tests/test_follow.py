"""04 --follow --consume beside a producer: shards trained in the order the index commits them,
each sample once, each shard deleted once trained and checkpointed, the producer held under
--max-store-gb; kill -9 of 04 then rerun equals an uninterrupted follow run with the same arrival
order; a producer that dies leaves 04 stopping at --follow-timeout with a line naming its log.

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
    return inputs_argv({**inputs, "store": store}, out, *extra, **flags)


class Producer:
    """Commits the shards of the complete store `src` into `dst` in shard order (copy, rename, index
    line), as 02 would: plan.json (with lengths) and header.json first; with `bound` it waits as
    02 --max-store-gb does. `stop_after` shards, then it dies. `peak`: the shard bytes on disk right
    after each commit (the store only grows at a commit, so that is its high-water mark)."""

    def __init__(self, src: Path, dst: Path, *, bound: int | None = None, stop_after: int | None = None,
                 delay: float = 0.0):
        self.src, self.dst, self.bound, self.stop_after, self.delay = Path(src), Path(dst), bound, stop_after, delay
        self.entries = sorted(hs.committed_shards(self.src).values(), key=lambda e: e["k"])
        self.peak = 0
        self.error = None
        self.dst.mkdir(parents=True, exist_ok=True)
        man = read_manifest(self.src)
        (self.dst / hs.HEADER).write_text(json.dumps({k: man.get(k) for k in hs.HEADER_KEYS}))
        plan = {"version": 1, "shards": [{"k": e["k"], "ids": e["ids"], "lengths": e["lengths"], "tokens": e["tokens"]}
                                         for e in self.entries]}
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


def test_follow_consume_beside_a_bounded_producer(inputs, tmp_path, monkeypatch):
    seen = record_training(monkeypatch)
    store = tmp_path / "store"
    shard = max(e["bytes"] for e in hs.committed_shards(inputs["store"]).values())
    bound = 2 * shard  # the producer may hold two shards; 04 must delete to let it go on
    with Producer(inputs["store"], store, bound=bound) as prod:
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
    assert last["follow"]["arrivals"] == list(range(N // SHARD)) == last["follow"]["consumed"]
    val = read_metrics(tmp_path / "run")["val"]
    assert val and val[-1]["step"] == man["counts"]["steps"]


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


def kill_then_rerun(inputs, tmp_path, kill_after_step: int, extra_delay: float, expect_consumed=False):
    ref_store, store = tmp_path / "ref-store", tmp_path / "store"
    with Producer(inputs["store"], ref_store):
        pass
    ref = tmp_path / "ref"
    run(stage.parse_args(argv(inputs, ref_store, ref, save_every=2)))
    out = tmp_path / "run"
    shard = max(e["bytes"] for e in hs.committed_shards(inputs["store"]).values())
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    with Producer(inputs["store"], store, bound=3 * shard, delay=0.2) as prod:
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
    got, want = read_metrics(out), read_metrics(ref)
    assert [r["step"] for r in got["train"]] == [r["step"] for r in want["train"]]
    for x, y in zip(want["train"], got["train"]):
        assert (x["loss"], x["loss_by_step"]) == (y["loss"], y["loss_by_step"])
    wa, wb = weights(ref), weights(out)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert shards_left(store) == []


def test_sigkill_of_follow_then_rerun_matches_uninterrupted(inputs, tmp_path):
    kill_then_rerun(inputs, tmp_path, kill_after_step=7, extra_delay=0.02, expect_consumed=True)


@pytest.mark.slow
@pytest.mark.parametrize("trial", range(6))
def test_sigkill_sweep(inputs, tmp_path, trial):
    import random

    rng = random.Random(trial)
    kill_then_rerun(inputs, tmp_path, kill_after_step=rng.randint(1, 12), extra_delay=rng.random() * 0.3)


def test_producer_that_dies_stops_follow_at_the_timeout(inputs, tmp_path):
    store = tmp_path / "store"
    with Producer(inputs["store"], store, stop_after=2):
        pass
    with pytest.raises(PipelineError, match=r"no new shard .* for 2 s .*2 of 6 committed.*see .*progress\.log"):
        run(stage.parse_args(argv(inputs, store, tmp_path / "run", follow_timeout=2)))


def test_consume_needs_follow(inputs, tmp_path, capsys):
    assert stage.entry.__module__  # the CLI refuses it in one line, exit 2
    from eagle3_train.common.errors import run_main

    rc = run_main(stage.main, inputs_argv(inputs, tmp_path / "run", consume=True))
    assert rc == 2 and "--consume deletes shards as --follow trains them" in capsys.readouterr().err


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
