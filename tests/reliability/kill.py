"""The kill harness: SIGKILL a stage at seeded moments, rerun the same command, and require the
output to equal an uninterrupted run's (a view).

A *moment* is "in the start-up", "once the output holds N bytes (+ a delay)" or "at time t of the
working window": tied to the run's own progress rather than only the wall clock, so kills land
inside the work on a loaded machine too, and reproducible from the seed."""
from __future__ import annotations

import dataclasses
import random
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .run import Result, run_stage, stage_cmd, stage_env
from .views import NOT_OUTPUT, diff_views, walk_files

# ----------------------------------------------------------------------------- progress probe


def probe_bytes(out: Path) -> int:
    """Bytes written under `out` so far, temp files included (they are work in progress)."""
    n = 0
    for p in walk_files(Path(out)):
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
          min_mid_run: float = 0.5, retries: int = 2, **moment_kw) -> list[Trial]:
    """`n` crash trials at seeded moments, each in its own directory under `root`, each required
    to end equal to `ref`. Every trial runs (a failure does not hide the others' results); then it
    fails on any failed trial, or if too few kills hit the stage mid-run (it would prove nothing)."""
    trials, failed = [], []
    for m in moments(seed, n, ref, **moment_kw):
        try:
            trial = crash_trial(spec, Path(root) / f"trial-{m.index:02d}", m, ref.view,
                                on_killed=on_killed, rerun=rerun)
            # A time in the working window is measured on the reference, the first (cold) run; a
            # warm trial can finish before it. Such a kill proves nothing, so it is drawn again
            # earlier (half the delay), in a fresh directory, up to `retries` times.
            for r in range(retries):
                if trial.mid_run or m.after_bytes != -1:
                    break
                m = dataclasses.replace(m, delay_s=round(m.delay_s / 2, 3))
                trial = crash_trial(spec, Path(root) / f"trial-{m.index:02d}-earlier-{r + 1}", m, ref.view,
                                    on_killed=on_killed, rerun=rerun)
            trials.append(trial)
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
