"""Running stages one after another as their own processes, as a user would by hand: the pilot
(eagle3_train/pilot) and the demo (scripts/demo.py) both drive the pipeline with this.

Per step: a banner; skipped when every output it makes is complete *and* its manifest matches
this run (`mismatch`: the target, the sizes, what the step passes that defines the data); refused
in one line naming the directory flag when a complete output was made by another run (another
profile's or target's directory: skipping it would report that run's figures as this one's); else
run, the stage resuming whatever part it had done. Stage times add up over interrupted and resumed
runs in a summary file.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from eagle3_train.common.errors import PipelineError
from eagle3_train.common.manifest import MANIFEST, is_complete, read_manifest
from eagle3_train.common.store import atomic_write_text
from eagle3_train.common.vllm_server import die_with_parent

SKIPPED, DONE, FAILED, NOT_RUN = "skipped", "done", "failed", "not run"


@dataclass(frozen=True)
class Output:
    """A stage's output directory, its stage id, and what its manifest must hold for this run to
    skip the stage: dotted keys into the manifest ("config.target") -> this run's value."""

    path: Path
    stage: str
    expect: dict = field(default_factory=dict)


@dataclass
class Step:
    name: str                    # "01b_generate_synthetic": the key of its time is "01b"
    what: str                    # one line for the banner
    fn: Callable[[], object]     # does the work (usually `Driver.call` of the stage's command)
    outputs: tuple[Output, ...] = ()  # none: always run (cheap, idempotent work)

    @property
    def key(self) -> str:
        return self.name.split("_")[0]


def _norm(value):
    """Values as a stage records them: a path as its resolved text, numbers as numbers."""
    if isinstance(value, Path):
        return str(value.resolve())
    if isinstance(value, str) and value.startswith("/"):
        return str(Path(value).resolve())
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, list | tuple):
        return [_norm(v) for v in value]
    return value


def _lookup(manifest: dict, dotted: str):
    node = manifest
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def mismatch(out: Output) -> str | None:
    """None when `out.path` holds no complete output or one made as `out.expect` says; else the
    first difference in words ("config.target is /a there, /b in this run")."""
    if not is_complete(out.path, out.stage):
        return None
    manifest = read_manifest(out.path, out.stage)
    for key, want in out.expect.items():
        found = _lookup(manifest, key)
        if _norm(found) != _norm(want):
            return f"{key} is {found!r} there, {str(want) if isinstance(want, Path) else want!r} in this run"
    return None


class Driver:
    """`tag` names the driver in its lines ("demo", "pilot"); `flag` is the option that chooses
    its directory, named when another run's output is found there; stage times accumulate in
    `summary` (JSON, key `stages_s`), rewritten after every step."""

    def __init__(self, out: Path, tag: str, *, flag: str, summary: Path):
        self.out, self.tag, self.flag, self.summary = Path(out), tag, flag, Path(summary)
        self.log = self.out / f"{tag}.log"
        prior = json.loads(self.summary.read_text()) if self.summary.exists() else {}
        self.times: dict[str, float] = dict(prior.get("stages_s", {}))
        self.status: dict[str, str] = {}  # this run's outcome per step key

    def banner(self, i: int, n: int, name: str, what: str) -> None:
        line = "=" * 78
        print(f"\n{line}\n[{self.tag} {i}/{n}] {name}: {what}\n{line}", flush=True)

    def say(self, text: str) -> None:
        print(f"[{self.tag}] {text}", flush=True)

    def call(self, cmd: list, *, ok=(0,)) -> int:
        """One stage as its own process (as a user would run it); its output goes to the terminal."""
        self.out.mkdir(parents=True, exist_ok=True)
        print("$ " + " ".join(str(c) for c in cmd), flush=True)
        with open(self.log, "a") as f:
            f.write(f"$ {' '.join(map(str, cmd))}\n")
        rc = subprocess.call([str(c) for c in cmd], preexec_fn=die_with_parent())
        if rc not in ok:
            script = next((Path(str(c)).name for c in cmd if str(c).endswith(".py")), str(cmd[0]))
            raise PipelineError(f"{script} exited with {rc}; fix the cause and rerun the {self.tag} "
                                "(finished work is kept)")
        return rc

    def generate(self, cmd: list, server=None) -> None:
        """01b as a process, against `server` (a vllm_server.VllmServer, its URL already in `cmd`)
        started for 01b's duration and stopped after, so that the next stage can have the
        accelerators; exit 1 (ids failed after retries) gets one more pass."""
        def go():
            if self.call(cmd, ok=(0, 1)) == 1:
                self.say("retrying the ids that failed")
                self.call(cmd)

        if server is None:
            return go()
        self.say(f"starting vLLM (log: {server.log_path}): {server.command_line()}")
        with server:
            go()

    def check(self, step: Step) -> bool:
        """Whether `step` is done for this run (skip it); refuses another run's complete output."""
        for out in step.outputs:
            why = mismatch(out)
            if why:
                raise PipelineError(f"{out.path} holds another run's {out.stage} output ({why}); pass another "
                                    f"{self.flag}, or move {out.path} aside")
        return bool(step.outputs) and all(is_complete(o.path, o.stage) for o in step.outputs)

    def preflight(self, steps: list[Step]) -> None:
        """Every step checked before any runs: another run's directory is refused before this run
        writes anything into it."""
        for step in steps:
            self.check(step)

    def run(self, i: int, n: int, step: Step) -> str:
        """Banner, then skip or do `step`; its time is added to the summary. Raises what it raised."""
        self.banner(i, n, step.name, step.what)
        if self.check(step):
            # Each stage would resume by itself; a finished one matching this run is skipped outright.
            self.say(f"{step.name} already complete ({step.outputs[-1].path / MANIFEST}); skipped")
            self.status[step.key] = SKIPPED
            return SKIPPED
        t0 = time.monotonic()
        try:
            step.fn()
        except BaseException:
            self.status[step.key] = FAILED
            raise
        finally:
            self.times[step.key] = self.times.get(step.key, 0.0) + time.monotonic() - t0
            self.save()
        self.status[step.key] = DONE
        self.say(f"{step.name} done in {time.monotonic() - t0:.0f} s")
        return DONE

    def save(self, **extra) -> dict:
        """Stage times so far (added up over interrupted and resumed runs) + `extra` figures."""
        summary = {"stages_s": {k: round(v) for k, v in self.times.items()},
                   "total_s": round(sum(self.times.values())), **extra}
        atomic_write_text(self.summary, json.dumps(summary, indent=2) + "\n")
        return summary

    def timings(self) -> str:
        return ", ".join(f"{k} {v:.0f}s" for k, v in self.times.items())
