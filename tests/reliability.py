"""The reliability harness: run a stage as a subprocess, SIGKILL it at seeded random moments, rerun
the same command, and compare what it left with an uninterrupted run's output.

    spec = StageSpec("03_build_vocab_mapping", argv=lambda out: [..., "--out", out], view=VIEWS["03"])
    ref = reference_run(spec, tmp / "reference")        # timed, uninterrupted
    sweep(spec, tmp, ref, seed=3, n=20)                  # 20 kills at seeded moments, each rerun

A *moment* is "in the start-up", "once the output holds N bytes (+ a delay)" or "at time t of the
working window": tied to the run's own progress rather than only the wall clock, so kills land
inside the work on a loaded machine too, and reproducible from the seed. Views reduce an output
directory to what must be equal between runs: JSONL as a multiset of records (each line parsed
strictly: a torn or malformed line, or a duplicate id, fails), safetensors and torch files as
tensors (bitwise), JSON without the fields that name a time, a pid or the run's own directory.

Also here: the tiny pipeline the reliability tests share (Chain), each stage's view (VIEWS), and
hostile environments (a full disk, a read-only mount, a lock held by another process).
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "eagle3-train"
TMP_PREFIX = ".tmp-"

# Fields that legitimately differ between two runs of the same command.
VOLATILE = frozenset({"created", "time", "pid", "command", "git_sha", "latency_s", "tokens_per_s",
                      "elapsed_s", "wall_s", "duration_s", "started", "finished", "this_run", "t",
                      "timestamp", "host", "hostname", "cpu_s"})
# Files that are never output: the lock, the human progress log.
NOT_OUTPUT = frozenset({".lock", "progress.log"})


# ----------------------------------------------------------------------------- running a stage

def stage_env(**extra: str) -> dict:
    """The environment of a stage subprocess: offline, no bars, one thread. Bytecode is cached
    under .cache/pycache even where PYTHONDONTWRITEBYTECODE is set: without it every start of a
    stage recompiles torch and transformers (~20 s of a loaded 2-core machine per run)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TQDM_DISABLE": "1",
                "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
                "PYTHONPYCACHEPREFIX": str(REPO / ".cache" / "pycache")})
    env.update(extra)
    return env


def stage_cmd(script: str, argv: Iterable[str]) -> list[str]:
    """A numbered stage by name (`03_build_vocab_mapping`), or any script by absolute path."""
    path = Path(script) if Path(script).is_absolute() else SCRIPTS / f"{script}.py"
    return [sys.executable, str(path), *map(str, argv)]


@dataclass
class Result:
    rc: int
    stdout: str
    stderr: str

    def error_lines(self) -> list[str]:
        return [ln for ln in self.stderr.splitlines() if ln.startswith("error:")]


def run_stage(cmd: list[str], *, timeout: float = 600, env: dict | None = None,
              preexec_fn=None) -> Result:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env or stage_env(),
                       preexec_fn=preexec_fn)
    return Result(p.returncode, p.stdout, p.stderr)


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


def run_inprocess(script: str, argv, capfd) -> Result:
    """A stage run in this process exactly as its script runs it (errors.run_main around main()),
    its output captured; an exception that escapes run_main (a traceback for a user) comes back
    as exit 1 with `Traceback` in stderr, so assert_one_error_line reports it."""
    from eagle3_train.errors import run_main

    capfd.readouterr()
    try:
        rc = run_main(load_stage(script).main, [str(a) for a in argv])
    except SystemExit as e:  # argparse
        rc = e.code if isinstance(e.code, int) else 2
    except BaseException as e:  # noqa: BLE001
        out, err = capfd.readouterr()
        return Result(1, out, f"{err}Traceback (escaped run_main): {type(e).__name__}: {e}")
    out, err = capfd.readouterr()
    return Result(rc, out, err)


# ----------------------------------------------------------------------------- progress probe

def _walk(out: Path):
    if not out.exists():
        return
    for dirpath, dirnames, filenames in os.walk(out):
        dirnames.sort()
        for name in sorted(filenames):
            yield Path(dirpath) / name


def probe_bytes(out: Path) -> int:
    """Bytes written under `out` so far, temp files included (they are work in progress)."""
    n = 0
    for p in _walk(Path(out)):
        if p.name in NOT_OUTPUT:
            continue
        try:
            n += p.stat().st_size
        except FileNotFoundError:  # renamed or removed between listing and stat
            pass
    return n


# ----------------------------------------------------------------------------- kill moments

@dataclass(frozen=True)
class Moment:
    """Kill once the output holds `after_bytes` bytes (0: counting from the start, -1: once the
    output directory exists), `delay_s` later. `kills` == 2 kills the resumed run as well."""
    index: int
    after_bytes: int
    delay_s: float
    kills: int = 1


@dataclass
class Reference:
    """An uninterrupted run of the stage, timed: the view to reproduce and where its time went."""
    out: Path
    view: dict
    final_bytes: int      # bytes under the output just before it claimed completeness
    startup_s: float      # start -> the output directory exists (imports, loading inputs)
    work_s: float         # the output directory exists -> the output claims completeness


def moments(seed: int, n: int, ref: Reference, *, max_delay_s: float = 0.3, double_share: float = 0.25,
            mix: tuple[float, float, float] = (0.15, 0.4, 0.45),
            byte_range: tuple[float, float] = (0.0, 1.0),
            window_range: tuple[float, float] = (0.0, 1.0)) -> list[Moment]:
    """`n` seeded kill moments for a run like `ref`. `mix` = shares of kills in the start-up, right
    after a uniformly drawn byte count of the output (within `byte_range` of what the reference
    wrote before its manifest; plus up to `max_delay_s`), and at a uniformly drawn time in the
    working window (within `window_range` of it, as measured on the reference run)."""
    rng = random.Random(seed)
    out = []
    lo, hi = (max(1, int(f * ref.final_bytes)) for f in byte_range)
    for i in range(n):
        r = rng.random()
        if r < mix[0]:
            after, delay = 0, rng.uniform(0.0, ref.startup_s)
        elif r < mix[0] + mix[1]:
            after, delay = rng.randint(lo, max(lo, hi - 1)), rng.uniform(0.0, max_delay_s)
        else:
            after, delay = -1, rng.uniform(*(f * ref.work_s for f in window_range))
        out.append(Moment(i, after, round(delay, 3), 2 if rng.random() < double_share else 1))
    return out


@dataclass
class Kill:
    killed: bool          # SIGKILL reached a live process (False: it had already exited)
    rc: int
    bytes_at_kill: int
    stderr: str = ""


def _armed(out: Path, after: int, probe) -> bool:
    if after == 0:
        return True
    if after < 0:
        return Path(out).exists()
    return probe(out) >= after


def kill_at(cmd: list[str], out: Path, moment: Moment, *, timeout: float = 600, env: dict | None = None,
            probe: Callable[[Path], int] = probe_bytes) -> Kill:
    """Start `cmd`, wait for the moment, SIGKILL it (if still running), and reap it."""
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    with open(Path(out).parent / f".kill-{Path(out).name}.stderr", "w+") as errf:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=errf, env=env or stage_env())
        try:
            deadline = time.monotonic() + timeout
            while proc.poll() is None and time.monotonic() < deadline:
                if _armed(out, moment.after_bytes, probe):
                    break
                time.sleep(0.005)
            if proc.poll() is None:
                time.sleep(moment.delay_s)
            at = probe(out)
            alive = proc.poll() is None
            if alive:
                proc.send_signal(signal.SIGKILL)
            rc = proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        errf.seek(0)
        err = errf.read()
    return Kill(alive, rc, at, err)


# ----------------------------------------------------------------------------- views

def _norm(obj, drop: frozenset, subs: tuple[tuple[str, str], ...]):
    if isinstance(obj, dict):
        return {k: _norm(v, drop, subs) for k, v in obj.items() if k not in drop}
    if isinstance(obj, list):
        return [_norm(v, drop, subs) for v in obj]
    if isinstance(obj, str):
        for a, b in subs:
            obj = obj.replace(a, b)
        return obj
    return obj


def strict_jsonl(path: Path) -> list[dict]:
    """Every line must be a complete JSON object ending in a newline: a torn line fails here."""
    data = Path(path).read_bytes()
    if data and not data.endswith(b"\n"):
        raise AssertionError(f"{path}: torn last line {data[-80:]!r}")
    recs = []
    for i, line in enumerate(data.split(b"\n")[:-1] if data else [], 1):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            raise AssertionError(f"{path}:{i}: not a JSON line: {line[:120]!r}") from None
        assert isinstance(rec, dict), f"{path}:{i}: not an object"
        recs.append(rec)
    return recs


def jsonl_view(path: Path, *, key: str | None = "id", drop: Iterable[str] = (), subs=()) -> list[str]:
    """A JSONL file as a sorted multiset of normalised records; with `key`, each value once."""
    recs = strict_jsonl(path)
    if key is not None:
        ids = [r.get(key) for r in recs if key in r]
        dup = sorted({i for i in ids if ids.count(i) > 1})
        assert not dup, f"{path}: duplicate {key}s {dup[:10]}"
    d = VOLATILE | frozenset(drop)
    return sorted(json.dumps(_norm(r, d, tuple(subs)), sort_keys=True) for r in recs)


def json_view(path: Path, *, drop: Iterable[str] = (), subs=()):
    return _norm(json.loads(Path(path).read_text()), VOLATILE | frozenset(drop), tuple(subs))


def _digest(t) -> tuple:
    import torch

    shape = tuple(t.shape)
    t = t.detach().cpu().reshape(-1).contiguous()
    raw = t.view(torch.uint8) if t.dtype != torch.bool else t.to(torch.uint8)
    return (str(t.dtype), shape, hashlib.sha256(raw.numpy().tobytes()).hexdigest())


def safetensors_view(path: Path) -> dict:
    """Tensor name -> (dtype, shape, sha256 of the bytes): equal views = bitwise-equal tensors
    (NaN-safe). The file's metadata is part of the view."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        view = {k: _digest(f.get_tensor(k)) for k in f.keys()}
        view["__metadata__"] = f.metadata()
    return view


def torch_view(path: Path, *, drop: Iterable[str] = (), subs=()):
    """A torch.save'd object with every tensor replaced by its digest."""
    import torch

    import numpy as np

    def walk(o):
        if isinstance(o, torch.Tensor):
            return _digest(o)
        if isinstance(o, np.ndarray):
            return ("ndarray", str(o.dtype), o.shape, hashlib.sha256(np.ascontiguousarray(o).tobytes()).hexdigest())
        if isinstance(o, dict):
            return {str(k): walk(v) for k, v in o.items() if k not in d}
        if isinstance(o, list | tuple):
            return [walk(v) for v in o]
        if isinstance(o, str):
            for a, b in subs:
                o = o.replace(a, b)
        return o

    d = VOLATILE | frozenset(drop)
    return walk(torch.load(path, map_location="cpu", weights_only=False))


def file_view(path: Path, **kw):
    """By suffix: JSONL/JSON/safetensors/torch views, else the bytes' sha256."""
    p = Path(path)
    if p.suffix == ".jsonl":
        return jsonl_view(p, key=kw.get("key", "id"), drop=kw.get("drop", ()), subs=kw.get("subs", ()))
    if p.suffix == ".json":
        return json_view(p, drop=kw.get("drop", ()), subs=kw.get("subs", ()))
    if p.suffix == ".safetensors":
        return safetensors_view(p)
    if p.suffix in (".pt", ".pth", ".bin"):
        return torch_view(p, drop=kw.get("drop", ()), subs=kw.get("subs", ()))
    return hashlib.sha256(p.read_bytes()).hexdigest()


def temp_files(out: Path) -> list[str]:
    return [str(p.relative_to(out)) for p in Path(out).rglob("*") if any(
        part.startswith(TMP_PREFIX) for part in p.relative_to(out).parts)]


def tree_view(out: Path, *, ignore: Callable[[str], bool] = lambda rel: False, drop: Iterable[str] = (),
              drop_in: dict[str, Iterable[str]] | Callable[[str], Iterable[str]] | None = None,
              key_for: Callable[[str], str | None] = lambda rel: "id", extra_subs=()) -> dict:
    """Relative path -> file view for every output file under `out`. The run's own directory is
    replaced by <OUT> inside JSON, so two runs into different directories compare equal; `drop`
    removes more keys everywhere, `drop_in[rel]` in one file only. Temp files fail the view: a
    finished run must leave none."""
    out = Path(out)
    stale = temp_files(out)
    assert not stale, f"{out}: temp files left behind: {stale}"
    subs = ((str(out.resolve()), "<OUT>"), (str(out), "<OUT>"), *extra_subs)
    view = {}
    for p in _walk(out):
        rel = str(p.relative_to(out))
        if p.name in NOT_OUTPUT or ignore(rel):
            continue
        more = drop_in(rel) if callable(drop_in) else (drop_in or {}).get(rel, ())
        view[rel] = file_view(p, key=key_for(rel), drop=(*drop, *more), subs=subs)
    return view


def diff_views(a: dict, b: dict, limit: int = 8) -> list[str]:
    """Readable differences between two views (for assertion messages)."""
    out = []
    for k in sorted(set(a) | set(b)):
        if k not in a:
            out.append(f"only in the second: {k}")
        elif k not in b:
            out.append(f"only in the first: {k}")
        elif a[k] != b[k]:
            va, vb = a[k], b[k]
            if isinstance(va, dict) and isinstance(vb, dict):
                sub = diff_views(va, vb, limit)
                out.append(f"{k}: " + "; ".join(sub)[:1500])
            elif isinstance(va, list) and isinstance(vb, list):
                only_a = [x for x in va if x not in vb][:2]
                only_b = [x for x in vb if x not in va][:2]
                out.append(f"{k}: {len(va)} vs {len(vb)} items; first-only {str(only_a)[:300]}; "
                           f"second-only {str(only_b)[:300]}")
            else:
                out.append(f"{k}: {str(va)[:200]} != {str(vb)[:200]}")
        if len(out) >= limit:
            break
    return out


# ----------------------------------------------------------------------------- crash trials

@dataclass
class StageSpec:
    """How to run one stage into a given output directory and what of its output must match."""
    script: str
    argv: Callable[[Path], list[str]]
    view: Callable[[Path], dict]
    env: dict | None = None
    complete: Callable[[Path], bool] = field(default=lambda out: (Path(out) / "manifest.json").exists())
    timeout: float = 600

    def args(self, out: Path) -> list[str]:
        return [str(a) for a in self.argv(Path(out))]

    def cmd(self, out: Path) -> list[str]:
        return stage_cmd(self.script, self.args(out))

    def run(self, out: Path) -> Result:
        return run_stage(self.cmd(out), timeout=self.timeout, env=self.env)


@dataclass
class Trial:
    moment: Moment
    kills: list[Kill]
    mid_run: int          # kills that hit a live process before its output was complete

    def describe(self) -> str:
        k = ", ".join(f"{'killed' if x.killed else 'already exited'} at {x.bytes_at_kill} B" for x in self.kills)
        return f"trial {self.moment.index} (after {self.moment.after_bytes} B + {self.moment.delay_s}s): {k}"


def crash_trial(spec: StageSpec, out: Path, moment: Moment, reference: dict, *,
                rerun: Callable[[Path], int] | None = None,
                on_killed: Callable[[Path], None] | None = None) -> Trial:
    """Kill the stage at `moment` (and its resumption too when moment.kills == 2), then rerun the
    same command to completion and require the output to equal `reference` (a view).

    After each kill: the output either claims completeness *and* equals the reference (the kill
    came after the manifest), or claims nothing. `on_killed(out)` may check more (e.g. that the
    next stage refuses the partial output). `rerun` replaces the final subprocess run (e.g. an
    in-process call), returning the exit code."""
    kills, mid = [], 0
    for k in range(moment.kills):
        # The resumed run is killed once it has added to what the first kill left.
        m = moment if k == 0 else dataclasses.replace(moment, after_bytes=probe_bytes(out) + 1)
        kill = kill_at(spec.cmd(out), out, m, timeout=spec.timeout, env=spec.env)
        kills.append(kill)
        if not kill.killed:
            assert kill.rc == 0, f"the run to be killed failed by itself (exit {kill.rc}):\n{kill.stderr[-3000:]}"
        if spec.complete(out):
            got = spec.view(out)
            assert got == reference, ("a kill left an output that claims completeness but differs: "
                                      + "; ".join(diff_views(reference, got)))
        elif kill.killed:
            mid += 1
            if on_killed is not None:
                on_killed(out)
    if rerun is not None:
        rc = rerun(out)
        assert rc == 0, f"rerun after the kill exited {rc}"
    else:
        res = spec.run(out)
        assert res.rc == 0, f"rerun after the kill exited {res.rc}:\n{res.stderr[-4000:]}"
    assert spec.complete(out), "rerun finished but the output does not claim completeness"
    got = spec.view(out)
    assert got == reference, "resumed output differs from the uninterrupted run: " + "; ".join(
        diff_views(reference, got))
    return Trial(moment, kills, mid)


def reference_run(spec: StageSpec, out: Path) -> Reference:
    """Run the stage uninterrupted (a subprocess, like the trials), timing its start-up and work."""
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    errf_path = Path(out).parent / f".ref-{Path(out).name}.stderr"
    with open(errf_path, "w+") as errf:
        t0 = time.monotonic()
        proc = subprocess.Popen(spec.cmd(out), stdout=subprocess.DEVNULL, stderr=errf, env=spec.env or stage_env())
        t_dir = t_done = None
        before = 0
        try:
            while proc.poll() is None:
                now = time.monotonic()
                if t_dir is None and Path(out).exists():
                    t_dir = now
                if t_done is None:
                    if spec.complete(out):
                        t_done = now
                    else:
                        before = probe_bytes(out)
                time.sleep(0.005)
                if time.monotonic() - t0 > spec.timeout:
                    raise AssertionError(f"reference run of {spec.script} took over {spec.timeout}s")
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        t_end = time.monotonic()
        errf.seek(0)
        err = errf.read()
    assert proc.returncode == 0, f"reference run of {spec.script} failed ({proc.returncode}):\n{err[-4000:]}"
    t_dir = t_dir or t_end
    return Reference(Path(out), spec.view(out), before or probe_bytes(out), t_dir - t0, (t_done or t_end) - t_dir)


def reference_from(spec: StageSpec, out: Path) -> Reference:
    """A finished output made some other way (e.g. in this process) as the reference; it has no
    timings, so only byte-triggered moments (mix=(0, 1, 0)) make sense against it."""
    out = Path(out)
    manifest = out / "manifest.json"
    before = probe_bytes(out) - (manifest.stat().st_size if manifest.exists() else 0)
    return Reference(out, spec.view(out), before, 0.0, 0.0)


def sweep(spec: StageSpec, root: Path, ref: Reference, *, seed: int, n: int, on_killed=None, rerun=None,
          min_mid_run: float = 0.5, **moment_kw) -> list[Trial]:
    """`n` crash trials at seeded moments, each in its own directory under `root`, each required
    to end equal to `ref`. Every trial runs (a failure does not hide the others' results); then it
    fails on any failed trial, or if too few kills hit the stage mid-run (it would prove nothing)."""
    trials, failed = [], []
    for m in moments(seed, n, ref, **moment_kw):
        try:
            trials.append(crash_trial(spec, Path(root) / f"trial-{m.index:02d}", m, ref.view,
                                      on_killed=on_killed, rerun=rerun))
        except AssertionError as e:
            failed.append((m, str(e).splitlines()[0][:600]))
    hits = sum(t.mid_run for t in trials)
    summary = (f"{spec.script}: {n} trials (seed {seed}), {len(trials)} passed, {len(failed)} failed; "
               f"{sum(len(t.kills) for t in trials)} kills in the passed ones, {hits} mid-run; "
               f"reference start-up {ref.startup_s:.1f}s, work {ref.work_s:.1f}s, {ref.final_bytes} B")
    print(summary)
    for t in trials:
        print("  " + t.describe())
    for m, why in failed:
        print(f"  FAILED trial {m.index} (after {m.after_bytes} B + {m.delay_s}s, {m.kills} kill(s)): {why}")
    assert not failed, f"{summary}; first failure: trial {failed[0][0].index}: {failed[0][1]}"
    assert hits >= max(1, int(min_mid_run * n)), f"too few kills landed mid-run to prove anything: {summary}"
    return trials


# ----------------------------------------------------------------------------- snapshots for "nothing lost"

def snapshot(directory: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file (the lock excluded): to prove a failed run changed
    nothing that was already there."""
    directory = Path(directory)
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in _walk(directory) if p.name != ".lock"}


def assert_unchanged(before: dict[str, str], directory: Path, *, allow_new: Callable[[str], bool] = lambda r: True):
    after = snapshot(directory)
    changed = [k for k in before if after.get(k) != before[k]]
    assert not changed, f"files changed or lost by the failed run: {changed}"
    new = [k for k in after if k not in before and not allow_new(k)]
    assert not new, f"unexpected new files: {new}"


# ----------------------------------------------------------------------------- inputs

def replicate_training_set(src: Path, dst: Path, times: int) -> Path:
    """A bigger tokenized set made cheaply: every record of `src` `times` times under new ids, with
    src's manifest (tokenizer, chat format) carried over, so stages have work worth interrupting."""
    from eagle3_train.manifest import read_manifest, write_manifest
    from eagle3_train.store import JsonlWriter, read_jsonl

    src, dst = Path(src), Path(dst)
    m = read_manifest(src, "tokenize")
    recs = list(read_jsonl(src / "data.jsonl"))
    with JsonlWriter(dst / "data.jsonl", fsync=False) as w:
        for r in range(times):
            for rec in recs:
                w.write({**rec, "id": f"{rec['id']}-r{r}"})
    keep = {k: v for k, v in m.items() if k in ("tokenizer", "chat_format")}
    counts = {k: (v * times if isinstance(v, int) else v) for k, v in m.get("counts", {}).items()}
    write_manifest(dst, "tokenize", config={**m.get("config", {}), "replicated": times}, counts=counts, **keep)
    return dst


# ----------------------------------------------------------------------------- a tiny pipeline

HS_ARGS = ["--shard-mb", "0.12", "--batch-tokens", "256", "--storage", "fp8", "--device", "cpu"]
TRAIN_ARGS = ["--max-tokens-per-batch", "256", "--ttt-steps", "3", "--val-fraction", "0.25",
              "--save-every", "3", "--log-every", "1", "--epochs", "1", "--lr", "3e-3", "--quiet",
              "--threads", "1", "--keep-last", "2"]


def load_stage(script: str):
    from helpers import load_script

    return load_script(script)


def argv01b(prompts: Path, out: Path, url: str, *extra) -> list[str]:
    return ["--input", str(prompts), "--output-dir", str(out), "--model", "fake", "--base-url", url, *map(str, extra)]


class Chain:
    """The tiny pipeline's outputs, each made once by the real stage (in this process) and reused:
    prompts -> 01b (gen, against the fake OpenAI server) -> 01c (tokenized) -> 02 (hs) -> 03 (vocab)
    -> 04 (run) -> 05 (eval). Directories under `base`; a step is done when its manifest is there,
    so the test modules of a session share one chain."""

    N_PROMPTS = 30

    def __init__(self, base: Path, tokenizer_dir: Path, target_dir: Path, server_url: str):
        self.base = Path(base)
        self.tokenizer_dir = Path(tokenizer_dir)
        self.target = Path(target_dir)
        self.url = server_url

    def _done(self, name: str) -> bool:
        return (self.base / name / "manifest.json").exists()

    @property
    def prompts(self) -> Path:
        p = self.base / "prompts.jsonl"
        if not p.exists():
            from helpers_generate import write_prompts

            self.base.mkdir(parents=True, exist_ok=True)
            write_prompts(p, [f"question {i}: " + "why " * (i % 7) for i in range(self.N_PROMPTS)])
        return p

    def argv01b(self, out: Path) -> list[str]:
        return argv01b(self.prompts, out, self.url)

    def argv01c(self, out: Path, raw: Path | None = None) -> list[str]:
        return ["--raw-dir", str(raw or self.gen), "--output-dir", str(out), "--tokenizer", str(self.tokenizer_dir)]

    def argv02(self, out: Path, data: Path | None = None) -> list[str]:
        return ["--input", str(data or self.tokenized), "--model", str(self.target), "--output", str(out), *HS_ARGS]

    def argv03(self, out: Path, data: Path | None = None) -> list[str]:
        return ["--data", str(data or self.tokenized), "--target", str(self.target), "--out", str(out),
                "--draft-vocab-size", "100"]

    def argv04(self, out: Path) -> list[str]:
        return ["--hidden-states", str(self.hs), "--vocab-mapping", str(self.vocab), "--target", str(self.target),
                "--out", str(out), *TRAIN_ARGS]

    def argv05(self, out: Path) -> list[str]:
        return ["--draft", str(self.run / "export"), "--store", str(self.hs), "--output-dir", str(out)]

    def _make(self, name: str, script: str, argv) -> Path:
        if not self._done(name):
            rc = load_stage(script).main(argv(self.base / name))
            assert rc == 0, f"{script} failed while building the chain"
        return self.base / name

    @property
    def gen(self) -> Path:
        return self._make("gen", "01b_generate_synthetic", self.argv01b)

    @property
    def tokenized(self) -> Path:
        return self._make("tokenized", "01c_tokenize", self.argv01c)

    @property
    def hs(self) -> Path:
        return self._make("hs", "02_extract_hidden_states", self.argv02)

    @property
    def vocab(self) -> Path:
        return self._make("vocab", "03_build_vocab_mapping", self.argv03)

    @property
    def run(self) -> Path:
        return self._make("run", "04_train", self.argv04)

    @property
    def eval(self) -> Path:
        return self._make("eval", "05_evaluate", self.argv05)


# ----------------------------------------------------------------------------- each stage's view

def view01b(out: Path) -> dict:
    """Records arrive in completion order (concurrency): compared as a multiset by id. How an
    answer travelled (endpoint, attempts, the server's URL: 01b lets them change on a resume) and
    the manifest's file hashes (they follow the order) are not part of the data."""
    return tree_view(out, drop=("endpoint", "attempts", "base_url", "base_urls"),
                     drop_in={"manifest.json": ["outputs"]}, ignore=lambda rel: rel.startswith("replaced-"))


def view02(out: Path) -> dict:
    # `seq` orders index lines by time; --force only skips the disk estimate
    return tree_view(out, drop_in={"index.jsonl": ["seq"], "manifest.json": ["force"]},
                     key_for=lambda rel: "shard" if rel.startswith("index") else "id")


def view03(out: Path) -> dict:
    # whether the counts were reused from before a kill is provenance, not output
    return tree_view(out, drop_in={"manifest.json": ["token_freq"]})


def metrics_view(path: Path) -> list[str]:
    """04's metrics.jsonl: steps redone after a resume are logged again and the last record of a
    kind and step wins (its documented contract); `resume` records mark the restarts."""
    last = {}
    for rec in strict_jsonl(path):
        if rec.get("kind") == "resume":
            continue
        last[(rec.get("kind"), rec.get("step"))] = rec
    # what a step cost (time, throughput, CPU seconds) differs between runs; what it computed may not
    keep = lambda k: k not in ("time", "path") and not k.endswith("_s")  # noqa: E731
    return sorted(json.dumps({k: v for k, v in r.items() if keep(k)}, sort_keys=True) for r in last.values())


def _drop04(rel: str) -> list[str]:
    if rel == "manifest.json":
        return ["outputs"]
    if "/rng/" in rel:
        # 04 seeds torch only (its data order comes from random.Random(seed) objects), so the
        # process-global Python/NumPy generators it also saves hold whatever the process started
        # with: they differ between any two runs and nothing reads them.
        return ["python", "numpy"]
    return []


def view04(out: Path) -> dict:
    view = tree_view(out, ignore=lambda rel: rel in ("metrics.jsonl", "curves.png"), drop_in=_drop04)
    view["metrics.jsonl"] = metrics_view(out / "metrics.jsonl")
    view["curves.png exists"] = (out / "curves.png").exists()
    return view


VIEWS = {"01b": view01b, "01c": tree_view, "02": view02, "03": view03, "04": view04, "05": tree_view}


# ----------------------------------------------------------------------------- hostile environments

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
from eagle3_train.store import DirLock
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
    for p in _walk(Path(directory)):
        if p.suffix == ".jsonl" and not p.name.startswith(TMP_PREFIX):
            recs = []
            for x in p.read_bytes().split(b"\n")[:-1]:
                try:
                    recs.append(json.loads(x))
                except json.JSONDecodeError:
                    pass
            out[str(p.relative_to(directory))] = recs
    return out


# ----------------------------------------------------------------------------- shared fixtures
# (import them by name into a test module; module-scoped, so each module gets its own)


@pytest.fixture(scope="module")
def fault_server(tmp_path_factory, k25_tokenizer_dir):
    """The fake OpenAI server (scripts/fault_server.py) answering with the k25 tokenizer's real ids."""
    from helpers_generate import FaultServer

    with FaultServer(tmp_path_factory.mktemp("fs"), "--tokenizer", str(k25_tokenizer_dir)) as fs:
        yield fs


@pytest.fixture(scope="module")
def chain(tmp_path_factory, k25_tokenizer_dir, llama_target_dir, fault_server):
    """The tiny pipeline, shared on disk by every module of the session (its answers are a pure
    function of the prompts, whichever module's server makes them)."""
    return Chain(tmp_path_factory.getbasetemp() / "chain", k25_tokenizer_dir, llama_target_dir, fault_server.url)
