"""status: every stage's state in a work directory, one line each, then the next command to run.

    uv run eagle3-train/status.py WORK            # e.g. $W, or runs/demo
    uv run eagle3-train/status.py WORK --json

Stages are found by their files, wherever they are under WORK (a manifest's stage, the .lock's
holder, progress.log, each stage's own files). States: done (its key figures), running (pid,
progress, rate, eta), interrupted (what a rerun of the same command redoes), failed (the last
`error:` line found), not started. Reads only: writes nothing and takes no lock, so it is safe
beside a running stage. Exit 0, or 2 when WORK is not a directory.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from eagle3_train.common.config import Settings, setting
from eagle3_train.common.errors import PipelineError, run_main


@dataclass(kw_only=True)
class StatusConfig(Settings):
    work: Path = setting(help="the work directory holding the stages' outputs ($W, runs/demo)")
    json: bool = setting(False, help="print the same as one JSON object")

    def __post_init__(self):
        # `status.py $W` with W unset: Path("") is ".", which would report on whatever is here
        if not str(self.work).strip():
            raise PipelineError("WORK is empty (is $W set?); pass the directory the stages write under")
        self.work = Path(self.work)
        if not self.work.exists():
            raise PipelineError(f"WORK {self.work} does not exist; pass the directory the stages write under")
        if not self.work.is_dir():
            raise PipelineError(f"WORK {self.work} is not a directory; pass the directory the stages write under")


def parse_args(argv=None) -> StatusConfig:
    C = StatusConfig
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("work", metavar="WORK", help=C.help("work"))
    g = p.add_argument_group("output")
    g.add_argument("--json", action="store_true", **C.arg("json"))
    return C.from_args(p.parse_args(argv))


def status(work: Path, now: float | None = None) -> dict:
    """{"work", "stages": [row per stage, in order], "next": {...}, "notes": [...]}."""
    from eagle3_train.status.probe import scan
    from eagle3_train.status.state import next_step, summarize

    now = time.time() if now is None else now
    work = Path(work).absolute()
    found, notes = scan(work)
    rows = summarize(found, now)
    return {"work": str(work), "stages": rows, "next": next_step(rows, found, str(work)), "notes": notes}


def render(report: dict) -> str:
    width = max(len(r["state"]) for r in report["stages"])
    lines = []
    for r in report["stages"]:
        where = f"  [{r['path']}]" if r["path"] else ""
        lines.append(f"{r['stage']:<4}{r['state']:<{width + 2}}{r['line']}{where}")
        for o in r.get("also", []):
            lines.append(f"{'':<{width + 6}}also {o['path']}: {o['state']}")
    lines += [f"note: {x}" for x in report["notes"]]
    nxt = report["next"]
    lines.append(f"next: {nxt['why']}" + (":" if nxt["command"] else ""))
    if nxt["command"]:
        lines.append(f"  {nxt['command']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    cfg = parse_args(argv)
    report = status(cfg.work)
    try:
        print(json.dumps(report, indent=2) if cfg.json else render(report), flush=True)
    except BrokenPipeError:  # `status.py W | head`: the reader took what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush says nothing
    return 0


def entry() -> None:
    """The script's and the console script's entry: a missing WORK is one `error:` line, exit 2."""
    sys.exit(run_main(main))


if __name__ == "__main__":
    entry()
