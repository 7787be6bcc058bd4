"""Shared plumbing of the benchmark scripts (scripts/bench_data.py, scripts/bench_quality.py):
the benchmark's directory layout, running a stage as its own process (as a user would), and
"done" meaning "its manifest is there"."""

from __future__ import annotations

import subprocess
import sys
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
