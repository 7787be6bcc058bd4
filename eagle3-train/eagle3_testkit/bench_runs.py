"""Shared plumbing of the benchmarks (scripts/bench/) and the GPU check (scripts/gpu_check.py): the
benchmark's directory layout, running a stage as its own process (as a user would), the tiny
training inputs made by the pipeline itself, the best lr of a sweep, and the results as JSON.
"Done" means "its manifest is there"."""

from __future__ import annotations

import argparse
import inspect
import json
import math
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from eagle3_train.common.errors import PipelineError
from eagle3_train.common.vllm_server import die_with_parent

from eagle3_testkit.fixtures import REPO_ROOT

STAGES = REPO_ROOT / "eagle3-train"
BENCH_TARGET = REPO_ROOT / "assets" / "bench-reasoner"
AUX_LAYERS = "1,3,4"  # issue 13's benchmark: aux layers [1, 3, 4] of the 6-layer target
DRAFT_VOCAB = 512
TRAIN_SEED, HELDOUT_SEED = 11, 12  # the target itself learned seed 1000's questions


def layout(root: Path) -> dict[str, Path]:
    root = Path(root)
    return {"root": root, "prompts": root / "prompts" / "train.jsonl",
            "heldout": root / "prompts" / "heldout.jsonl", "gen": root / "01b",
            "tokenized": root / "01b" / "tokenized", "hidden": root / "02", "vocab": root / "03",
            "summary": root / "data.json"}


def made_data(root: Path) -> dict[str, Path]:
    """layout(root) of a set scripts/bench/data.py has made; what it lacks is refused in one line."""
    from eagle3_train.common.errors import PipelineError

    d = layout(root)
    for key in ("hidden", "vocab", "heldout"):
        if not d[key].exists():
            raise PipelineError(f"{d[key]} is missing: run scripts/bench/data.py --root {root} first")
    return d


def run_stage(script: str, args: list, log: Path, *, ok=(0,)) -> int:
    """One stage script as its own process, its output appended to `log`."""
    cmd = [sys.executable, str(STAGES / script), *map(str, args)]
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, preexec_fn=die_with_parent())
    if rc not in ok:
        raise PipelineError(f"{script} exited with {rc}; see {log} (finished work is kept, rerun to resume)")
    return rc


def training_inputs(work: Path, target: Path, n: int) -> tuple[Path, Path]:
    """n synthetic samples tokenized for `target` -> 02 (hf, fp32) -> 03 (256 tokens), in this process,
    under `work`; a step whose output is complete is kept. Returns (02 store, 03 mapping)."""
    from eagle3_train.extract.cli import main as extract_main
    from eagle3_train.vocab.cli import main as vocab_main

    from eagle3_testkit.fixtures import synthetic_training_set

    data, hs, vocab = work / "tokenized", work / "hidden", work / "vocab"
    if not (data / "manifest.json").exists():
        synthetic_training_set(data, target, n=n, seed=4242, id_prefix="b", id_width=5)
    if not (hs / "manifest.json").exists():
        extract_main(["--input", str(data), "--output", str(hs), "--model", str(target), "--storage", "fp32"])
    if not (vocab / "manifest.json").exists():
        vocab_main(["--data", str(data), "--target", str(target), "--out", str(vocab), "--draft-vocab-size", "256"])
    return hs, vocab


def best_lr(rows: list[dict]) -> float | None:
    """The vertex of a parabola through log(lr) -> val_al at the best point and its two neighbours
    (None at an edge of the grid: the best lies outside it)."""
    rows = sorted((r for r in rows if "val_al" in r), key=lambda r: r["lr"])
    i = max(range(len(rows)), key=lambda k: rows[k]["val_al"]) if rows else 0
    if not 0 < i < len(rows) - 1:
        return None
    (x0, y0), (x1, y1), (x2, y2) = [(math.log(r["lr"]), r["val_al"]) for r in rows[i - 1: i + 2]]
    den = (x0 - x1) * (x0 - x2) * (x1 - x2)
    a = (x2 * (y1 - y0) + x1 * (y0 - y2) + x0 * (y2 - y1)) / den
    b = (x2 * x2 * (y0 - y1) + x1 * x1 * (y2 - y0) + x0 * x0 * (y1 - y2)) / den
    return math.exp(-b / (2 * a)) if a < 0 else None


@contextmanager
def workdir(keep: Path | None, prefix: str) -> Iterator[Path]:
    """`keep` (--workdir, made if missing and left in place), else a temporary directory removed after."""
    if keep:
        keep.mkdir(parents=True, exist_ok=True)
        yield keep
        return
    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_json(path: Path | None, results) -> None:
    """The results at `path` (a benchmark's --json), if one is given."""
    if path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=2, default=str) + "\n")


def subcommands(description: str, commands: dict):
    """A benchmark's parser with one subcommand per function in `commands`, and `command(name,
    summary)` that adds one: `summary` in the list, the function's docstring as its --help."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)

    def command(name: str, summary: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=summary, description=inspect.cleandoc(commands[name].__doc__ or ""),
                              formatter_class=argparse.RawDescriptionHelpFormatter)

    return p, command
