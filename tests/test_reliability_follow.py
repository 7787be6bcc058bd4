"""kill -9 sweeps (-m slow, seeded moments, RELIABILITY_TRIALS each, default 20) for the producer and
follower modes of a store under a disk bound:

  (a) 01b --capture-hidden-states --max-store-gb, the server a stand-in (tests/capture_server.py: answers
      and per-request files as vLLM's connector writes them; the real capture path: tests/test_capture.py);
  (b) 02 --max-store-gb --stop-when-full, rerun until complete;
  (c) 04 --follow --consume beside a bounded producer (test_follow.Producer);
  (d) 02 --max-store-gb and 04 --follow --consume together, each killed at its own seeded moment,
      then both resumed.

In (a) and (b) a stand-in consumer does what 04 --consume does to the store (a committed shard leaves
it), moving each into `<store>/consumed/` so the data can still be compared. After each resume:
every id once in the answers, in the store (committed shards, consumed or not) and in what 04
trained; each sample's rows bit for bit those of an uninterrupted run (04: the same losses and
weights); no temp file, journal, shard file without its index line or per-request file left; and
the disk, sampled every 10 ms during the whole trial (the killed runs, the gaps and the reruns),
never above the bound + one shard + what is in flight (01b: --concurrency request files and their
answers; 02/04: nothing more)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from eagle3_train.common import hidden_store as hs
from eagle3_train.common.vllm_server import free_port
from eagle3_train.train import run as train_run
from eagle3_train.train.metrics import read_metrics
from helpers import REPO
from helpers_generate import write_prompts
from reliability import (  # noqa: F401
    Moment,
    Reference,
    StageSpec,
    chain,
    crash_trial,
    fault_server,
    jsonl_view,
    kill_at,
    moments,
    reference_run,
    stage_cmd,
    stage_env,
    sweep,
    temp_files,
)
from reliability.views import _digest
from test_follow import SHARDS_02, Producer, argv, inputs, producer_02, stage  # noqa: F401

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TRIALS = int(os.environ.get("RELIABILITY_TRIALS", "20"))
CONSUMED = "consumed"  # the stand-in consumer's copy of what it took, inside the store (no shard- name at the top)


# ----------------------------------------------------------------------------- the store's side


def samples_view(store: Path) -> dict:
    """id -> the digests of its rows in every tensor, read from the committed shards (in the store or
    taken by the consumer); an id in two committed shards fails."""
    out = {}
    for e in hs.committed_shards(store).values():
        from safetensors import safe_open

        for where in (store, store / CONSUMED, store / CONSUMED):  # moved meanwhile: the consumer's copy
            try:
                f = safe_open(str(where / e["shard"]), framework="pt")
                break
            except Exception:  # noqa: BLE001 -- missing here (safetensors raises its own error)
                continue
        else:
            raise AssertionError(f"{store}: committed {e['shard']} is neither in the store nor consumed")
        for sid, off, n in zip(e["ids"], e["offsets"], e["lengths"], strict=True):
            assert sid not in out, f"{store}: sample {sid} in two committed shards"
            out[sid] = {k: _digest(f.get_slice(k)[off: off + n]) for k in sorted(f.keys())}
    return out


def assert_store_clean(store: Path) -> None:
    """No temp file, no shard file without its index line, every committed shard in exactly one place."""
    assert not temp_files(store), f"{store}: temp files left: {temp_files(store)}"
    committed = {e["shard"] for e in hs.committed_shards(store).values()}
    here = {p.name for p in store.glob("shard-*.safetensors")}
    taken = {p.name for p in (store / CONSUMED).glob("shard-*.safetensors")}
    assert here <= committed, f"{store}: shard files no index line commits: {sorted(here - committed)}"
    assert not here & taken and here | taken == committed, (sorted(here), sorted(taken), sorted(committed))
    assert not list(store.glob("bad-*")), f"{store}: shards were dropped: {list(store.glob('bad-*'))}"


class Watch:
    """A thread over every trial directory under `root` (each `store_of(dir)`): samples the store's shard
    bytes plus the connector's request files (`requests_of(dir)`) every 10 ms, keeping each directory's
    high-water mark (it may miss a peak, never invents one); with `consume_every`, it is also the
    consumer: the oldest committed shard still in a store moves to <store>/consumed/ that often."""

    def __init__(self, root: Path, store_of, requests_of=lambda d: None, consume_every: float | None = None):
        self.root, self.store_of, self.requests_of, self.every = Path(root), store_of, requests_of, consume_every
        self.peak: dict[str, int] = {}
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self._last_take: dict[Path, float] = {}

    def _loop(self):
        try:
            while not self.done.is_set():
                for d in sorted(p for p in self.root.iterdir() if p.is_dir()):
                    store = self.store_of(d)
                    if not store.is_dir():
                        continue
                    try:
                        used = hs.store_bytes(store) + hs.request_bytes(self.requests_of(d))
                    except FileNotFoundError:
                        continue
                    self.peak[d.name] = max(self.peak.get(d.name, 0), used)
                    if self.every is not None and time.monotonic() - self._last_take.get(store, 0) >= self.every:
                        self._take(store)
                time.sleep(0.01)
        except BaseException as e:  # surfaced by the test
            self.error = e

    def _take(self, store: Path) -> None:
        try:
            entries = sorted(hs.committed_shards(store).values(), key=lambda e: e["seq"])
        except Exception:  # noqa: BLE001 -- an index line being appended: next round
            return
        for e in entries:
            src = store / e["shard"]
            if src.exists():
                (store / CONSUMED).mkdir(exist_ok=True)
                os.replace(src, store / CONSUMED / e["shard"])
                self._last_take[store] = time.monotonic()
                return

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join(timeout=60)


def check_trials(root: Path, watch: Watch, check_one) -> None:
    """`check_one(dir)` for every trial directory of a sweep (the reference included); all are checked."""
    assert watch.error is None, f"the watch thread failed: {watch.error!r}"
    dirs = sorted(p for p in Path(root).iterdir() if p.is_dir() and (p.name.startswith("trial-")
                                                                      or p.name == "reference"))
    failed = []
    for d in dirs:
        try:
            check_one(d)
        except AssertionError as e:
            failed.append(f"{d.name}: {str(e).splitlines()[0][:400]}")
    print(f"checked {len(dirs)} directories; peaks: " + ", ".join(f"{k} {v}" for k, v in sorted(watch.peak.items())))
    assert not failed, f"{len(failed)} directories fail: " + " | ".join(failed[:5])


# ----------------------------------------------------------------------------- (a) 01b capture

N_PROMPTS = 40
CONCURRENCY = 3
TINY_LAYERS, TINY_H = 4, 64  # the tiny reasoner: vLLM is asked for layers [2, 4, 5, 8], hidden size 64


class CaptureServer:
    """tests/capture_server.py as a process; `use(dir)` points its files at one 01b's .vllm-requests."""

    def __init__(self, workdir: Path, tokenizer: Path, delay: float):
        self.port = free_port()
        self.dir_file = Path(workdir) / "capture-server.dir"
        self.dir_file.write_text(str(workdir))
        self.cmd = [sys.executable, str(REPO / "tests" / "capture_server.py"), "--port", str(self.port),
                    "--tokenizer", str(tokenizer), "--dir-file", str(self.dir_file), "--layers", str(TINY_LAYERS),
                    "--hidden-size", str(TINY_H), "--delay", str(delay)]
        self.log = Path(workdir) / "capture-server.out"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def use(self, out: Path) -> None:
        self.dir_file.write_text(str((Path(out) / ".vllm-requests").resolve()))

    def __enter__(self):
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, env=stage_env())
        deadline = time.monotonic() + 120  # a bound on a hang
        while True:
            assert self.proc.poll() is None, f"capture server exited: {self.log.read_text()[-2000:]}"
            try:
                with urllib.request.urlopen(self.url + "/models", timeout=1):
                    return self
            except OSError:
                assert time.monotonic() < deadline, "capture server did not start"
                time.sleep(0.1)

    def __exit__(self, *exc):
        self.proc.terminate()
        self.proc.wait(10)


def capture_view(out: Path) -> dict:
    return {"answers": jsonl_view(out / "raw_responses.jsonl", drop=("endpoint", "attempts")),
            "samples": samples_view(out / "hidden")}


def test_kill9_sweep_01b_capture_bounded(tmp_path, tiny_reasoner_dir):
    root = tmp_path
    prompts = write_prompts(root / "prompts.jsonl", [f"question {i}: " + "why " * (i % 9) for i in range(N_PROMPTS)])
    # fp8 rows: ~280 B a token in the store; the connector's fp32 files ~1 KB a token; answers ~60-90 tokens
    bound, shard_mb = 150_000, 0.06
    with CaptureServer(root, tiny_reasoner_dir, delay=0.05) as server:
        def args(out: Path) -> list[str]:
            server.use(out)  # the command for `out` is made just before it runs: the server writes there
            return ["--input", prompts, "--output-dir", out, "--model", "fake", "--target", tiny_reasoner_dir,
                    "--base-url", server.url, "--no-preflight", "--wait-for-server", "0", "--capture-hidden-states",
                    "--storage", "fp8", "--shard-mb", shard_mb, "--concurrency", CONCURRENCY,
                    "--max-store-gb", bound / 1e9, "--timeout", "120"]

        spec = StageSpec("01b_generate_synthetic", argv=args, view=capture_view)
        with Watch(root, lambda d: d / "hidden", lambda d: d / ".vllm-requests", consume_every=0.3) as watch:
            ref = reference_run(spec, root / "reference")
            sweep(spec, root, ref, seed=101, n=TRIALS, min_mid_run=0.4)
        shard = max(e["bytes"] for e in hs.committed_shards(root / "reference" / "hidden").values())
        # the longest answer's request file (fp32 rows, a header) and its rows in the store, per request in flight
        longest = max(s["input_ids"][1][0] for s in ref.view["samples"].values())
        in_flight = CONCURRENCY * (longest * (TINY_LAYERS * TINY_H * 4 + hs.bytes_per_token("fp8", 3, TINY_H)) + 1024)
        print(f"disk limit: bound {bound} + one shard {shard} + in flight {in_flight} = {bound + shard + in_flight} B")

    def check(d: Path) -> None:
        store = d / "hidden"
        assert_store_clean(store)
        assert not list((store / ".capture").iterdir()), "a journal left"
        assert not list((d / ".vllm-requests").iterdir()), "per-request files left that no run will commit"
        answers = [json.loads(x) for x in (d / "raw_responses.jsonl").read_text().splitlines()]
        ids = [r["id"] for r in answers]
        assert len(ids) == len(set(ids)) == N_PROMPTS
        assert sorted(samples_view(store)) == sorted(r["id"] for r in answers if r["captured"])
        assert watch.peak[d.name] <= bound + shard + in_flight, (watch.peak[d.name], bound, shard, in_flight)

    check_trials(root, watch, check)
    assert len(ref.view["samples"]) == N_PROMPTS


# ----------------------------------------------------------------------------- (b) 02 --stop-when-full

def test_kill9_sweep_02_bounded_stop_when_full(tmp_path, chain):
    root = tmp_path
    whole = chain.hs  # the uninterrupted, unbounded run: the same plan, so the same shards
    shards = hs.committed_shards(whole)
    shard = max(e["bytes"] for e in shards.values())
    bound = 2 * shard
    assert len(shards) >= 4, "too few shards for the bound to bite"

    def args(out: Path) -> list[str]:
        return [*chain.argv02(out), "--max-store-gb", bound / 1e9, "--stop-when-full"]

    def view(out: Path) -> dict:
        return {"samples": samples_view(out), "shards": {e["shard"]: e["ids"] for e in
                                                         hs.committed_shards(out).values()}}

    def complete(out: Path) -> bool:
        return (out / "manifest.json").exists()

    spec = StageSpec("02_extract_hidden_states", argv=args, view=view, complete=complete)

    def until_complete(out: Path) -> int:
        """The one-box alternation: rerun the same command (each exits 0 once the store is full) until
        the manifest; between turns the consumer makes room, as 04 --follow --consume would."""
        for _turn in range(40):
            if complete(out):
                return 0
            deadline = time.monotonic() + 120  # a bound on a hang
            while hs.store_bytes(out) > bound and time.monotonic() < deadline:
                time.sleep(0.05)
            res = spec.run(out)
            if res.rc != 0:
                print(res.stderr[-3000:])
                return res.rc
        return 1

    with Watch(root, lambda d: d, consume_every=0.5) as watch:
        timed = reference_run(StageSpec(spec.script, argv=args, view=lambda out: {}, complete=complete),
                              root / "reference")
        assert until_complete(root / "reference") == 0
        ref = Reference(root / "reference", view(whole), timed.final_bytes, timed.startup_s, timed.work_s)
        assert view(root / "reference") == ref.view
        sweep(spec, root, ref, seed=102, n=TRIALS, min_mid_run=0.4, rerun=until_complete)

    def check(d: Path) -> None:
        assert_store_clean(d)
        ids = [i for e in hs.committed_shards(d).values() for i in e["ids"]]
        assert sorted(ids) == sorted(i for e in shards.values() for i in e["ids"]) and len(ids) == len(set(ids))
        assert watch.peak[d.name] <= bound + shard, (watch.peak[d.name], bound, shard)

    check_trials(root, watch, check)


# ----------------------------------------------------------------------------- (c), (d) 04 --follow --consume

def follow_view(out: Path) -> dict:
    """What an uninterrupted follow run is bit for bit: every training step's losses, the exported
    weights, the held-out ids."""
    from safetensors.torch import load_file

    train = [(r["step"], r["loss"], r["loss_by_step"]) for r in read_metrics(out)["train"]]
    w = load_file(str(out / "export" / "model.safetensors"))
    man = json.loads((out / "manifest.json").read_text())
    return {"train": train, "weights": {k: _digest(v) for k, v in sorted(w.items())},
            "val_ids": sorted(man["split"]["val_ids"])}


def store_of(out: Path) -> Path:
    return out.parent / f"{out.name}-store"


def assert_follow_clean(out: Path, all_ks: list[int], all_ids: list[str]) -> None:
    """Every shard consumed once and deleted, nothing left behind, every id trained or held out once."""
    store = store_of(out)
    assert not list(store.glob("shard-*.safetensors")), "shards left in the followed store"
    assert not temp_files(store) and not temp_files(out), (temp_files(store), temp_files(out))
    last = json.loads(sorted((out / "checkpoints").glob("step-*/state.json"))[-1].read_text())["follow"]
    assert last["consumed"] == sorted(set(last["consumed"])) == sorted(all_ks), last["consumed"]
    assert sorted(last["arrivals"]) == sorted(all_ks), last["arrivals"]
    entries = hs.committed_shards(store)
    trained = [i for k in last["consumed"] for i in entries[k]["ids"]]
    assert sorted(trained) == sorted(all_ids), "each id in exactly one consumed shard"
    man = json.loads((out / "manifest.json").read_text())
    assert sorted(hs.HiddenStates(out / "heldout").ids) == sorted(man["split"]["val_ids"])


def check_follow_trials(root: Path, watch: Watch, all_ks: list[int], all_ids: list[str], most: int) -> None:
    """check_trials for the 04 --follow --consume sweeps: each run's output clean, its store's disk peak <= `most`."""
    def check(d: Path) -> None:
        if d.name.endswith("-store"):
            return
        assert_follow_clean(d, all_ks, all_ids)
        assert watch.peak[d.name] <= most, (watch.peak[d.name], most)

    check_trials(root, watch, check)


def in_process_04(inputs):  # noqa: F811
    def rerun(out: Path) -> int:
        train_run(stage.parse_args(argv(inputs, store_of(out), out, save_every=2)))
        return 0

    return rerun


def trials(name: str, ms: list, one) -> None:
    """Run `one(moment)` for every moment (a failure does not hide the others), then fail on any."""
    failed, hits = [], 0
    for m in ms:
        try:
            hits += one(m)
        except Exception as e:  # noqa: BLE001 -- every trial runs; a failure does not hide the others
            failed.append(f"trial {m[0].index if isinstance(m, tuple) else m.index}: {str(e).splitlines()[0][:500]}")
    print(f"{name}: {len(ms)} trials, {len(ms) - len(failed)} passed, {hits} kills mid-run")
    for f in failed:
        print("  FAILED " + f)
    assert not failed, f"{name}: {len(failed)} of {len(ms)} trials failed; first: {failed[0]}"
    assert hits >= max(1, int(0.4 * len(ms))), f"{name}: too few kills landed mid-run ({hits})"


def test_kill9_sweep_04_follow_consume(tmp_path, inputs):  # noqa: F811
    root = tmp_path
    entries = hs.committed_shards(inputs["store"])
    shard = max(e["bytes"] for e in entries.values())
    bound = 3 * shard
    all_ks, all_ids = sorted(entries), sorted(i for e in entries.values() for i in e["ids"])
    spec = StageSpec("04_train", argv=lambda out: argv(inputs, store_of(out), out, save_every=2), view=follow_view)
    with Watch(root, store_of) as watch:
        with Producer(inputs["store"], store_of(root / "reference"), bound=bound, delay=0.2) as prod:
            ref = reference_run(spec, root / "reference")
        assert prod.error is None

        def one(m: Moment) -> int:
            out = root / f"trial-{m.index:02d}"
            with Producer(inputs["store"], store_of(out), bound=bound, delay=0.2) as prod:
                t = crash_trial(spec, out, m, ref.view, rerun=in_process_04(inputs))
            assert prod.error is None, prod.error
            return t.mid_run

        trials("04 --follow --consume", moments(103, TRIALS, ref), one)

    check_follow_trials(root, watch, all_ks, all_ids, bound + shard)


def test_kill9_sweep_02_and_04_together(tmp_path, inputs):  # noqa: F811
    """02 --max-store-gb (hf) and 04 --follow --consume started together; each SIGKILLed at its own
    seeded moment (in its start-up or its working window); then both rerun together (02 as a process,
    04 here) and the follow run equals an uninterrupted one started the same way."""
    root = tmp_path
    bound = 2_000_000
    env = stage_env()

    def cmd02(out: Path) -> list[str]:
        return producer_02(inputs, store_of(out), "--backend", "hf", "--device", "cpu", *SHARDS_02,
                           "--max-store-gb", str(bound / 1e9))

    cmd04 = lambda out: stage_cmd("04_train", argv(inputs, store_of(out), out, save_every=2))  # noqa: E731

    def both(out: Path) -> None:
        """Both to the end, together: 02 as a process, 04 in this one."""
        p = subprocess.Popen(cmd02(out), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            in_process_04(inputs)(out)
            err = p.communicate(timeout=600)[1]
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        assert p.returncode == 0, err[-2000:]

    with Watch(root, store_of) as watch:
        # the reference, timed per process: each one's start-up and working window for the moments
        ref_out = root / "reference"
        root.joinpath("logs").mkdir()
        t0 = time.monotonic()
        with open(root / "logs" / "ref-02.err", "w+") as e02, open(root / "logs" / "ref-04.err", "w+") as e04:
            p = subprocess.Popen(cmd02(ref_out), env=env, stdout=subprocess.DEVNULL, stderr=e02)
            q = subprocess.Popen(cmd04(ref_out), env=env, stdout=subprocess.DEVNULL, stderr=e04)
        t_store = t_02 = t_run = t_04 = None
        while p.poll() is None or q.poll() is None:
            now = time.monotonic()
            t_store = t_store or (now if store_of(ref_out).exists() else None)
            t_run = t_run or (now if ref_out.exists() else None)
            t_02 = t_02 or (now if p.poll() is not None else None)
            t_04 = t_04 or (now if q.poll() is not None else None)
            assert now - t0 < 900, "the reference pair ran over 15 minutes"
            time.sleep(0.01)
        now = time.monotonic()
        assert p.returncode == 0 and q.returncode == 0, [(root / "logs" / f).read_text()[-2000:]
                                                         for f in ("ref-02.err", "ref-04.err")]
        ref02 = Reference(store_of(ref_out), {}, 0, (t_store or now) - t0, (t_02 or now) - (t_store or now))
        ref04 = Reference(ref_out, follow_view(ref_out), 0, (t_run or now) - t0, (t_04 or now) - (t_run or now))
        print(f"reference pair: 02 start-up {ref02.startup_s:.1f}s, work {ref02.work_s:.1f}s; "
              f"04 start-up {ref04.startup_s:.1f}s, work {ref04.work_s:.1f}s")
        # a kill in the start-up or at a time in the working window, counted from the process's start: a
        # byte count, or the output's appearance, would tie one to the other's progress (04 makes its
        # output only once 02 has written header.json)
        def from_start(m: Moment, ref: Reference) -> Moment:
            return m if m.after_bytes == 0 else Moment(m.index, 0, round(ref.startup_s + m.delay_s, 3))

        ms = list(zip([from_start(m, ref02) for m in moments(104, TRIALS, ref02, mix=(0.15, 0.0, 0.85),
                                                             double_share=0.0)],
                      [from_start(m, ref04) for m in moments(204, TRIALS, ref04, mix=(0.15, 0.0, 0.85),
                                                             double_share=0.0)], strict=True))
        entries = hs.committed_shards(store_of(ref_out))
        shard = max(e["bytes"] for e in entries.values())
        all_ks, all_ids = sorted(entries), sorted(i for e in entries.values() for i in e["ids"])

        def one(pair) -> int:
            m02, m04 = pair
            out = root / f"trial-{m02.index:02d}"
            kills = {}
            ts = [threading.Thread(target=lambda: kills.__setitem__("02", kill_at(cmd02(out), store_of(out), m02,
                                                                                  env=env))),
                  threading.Thread(target=lambda: kills.__setitem__("04", kill_at(cmd04(out), out, m04, env=env)))]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            for k, kill in kills.items():
                # 04 may also have stopped as documented: the producer killed before its header.json came
                # (exit 2 at --follow-timeout) or before its next shard (exit 75, checkpointed)
                stopped = k == "04" and (kill.rc == 75 or kill.rc == 2 and "no header.json" in kill.stderr)
                assert kill.killed or kill.rc == 0 or stopped, f"{k} failed by itself (exit {kill.rc}): " \
                                                               f"{kill.stderr[-1500:]}"
            killed_at = time.monotonic()
            both(out)
            print(f"trial {m02.index}: 02 {m02.after_bytes} B + {m02.delay_s}s, 04 {m04.after_bytes} B + "
                  f"{m04.delay_s}s: killed {[k for k, x in kills.items() if x.killed]}, both rerun in "
                  f"{time.monotonic() - killed_at:.0f}s")
            got = follow_view(out)
            assert got == ref04.view, f"resumed pair differs: train {got['train'] == ref04.view['train']}, " \
                                      f"weights {got['weights'] == ref04.view['weights']}"
            assert (store_of(out) / "manifest.json").exists()
            return sum(k.killed for k in kills.values()) == 2

        trials("02 + 04 --follow --consume", ms, one)

    check_follow_trials(root, watch, all_ks, all_ids, bound + shard)
