"""04_train killed with SIGKILL at a random moment, then rerun with the same command: it resumes
from the last complete checkpoint and ends with the same weights and loss trajectory as an
uninterrupted run. One trial by default; `-m slow` runs a sweep of seeded kill times."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from eagle3_train.train import run
from eagle3_train.train.metrics import read_metrics
from helpers import inputs_argv, script_path, stage_cli
from helpers_train import train_inputs
from safetensors.torch import load_file

pytestmark = pytest.mark.e2e  # stage processes, kill -9, real files: the slow part of the suite

SCRIPT = script_path("04_train")
stage = stage_cli("04_train")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, llama_target_dir):
    return train_inputs(tmp_path_factory.mktemp("resume"), llama_target_dir, n=24, shard_size=8)


def argv(inputs, out):
    return inputs_argv(inputs, out, max_tokens_per_batch=160, val_fraction=0.2, epochs=3, keep_last=1)


@pytest.fixture(scope="module")
def reference(inputs):
    out = inputs["root"] / "reference"
    run(stage.parse_args(argv(inputs, out)))
    return out


def steps_logged(out: Path) -> int:
    try:
        return max((r["step"] for r in read_metrics(out).get("train", [])), default=0)
    except Exception:  # a line being written
        return 0


def kill_then_resume(inputs, reference, out: Path, kill_after_step: int, extra_delay: float) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, str(SCRIPT), *argv(inputs, out)], env=env,
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
    assert not (out / "manifest.json").exists()
    run(stage.parse_args(argv(inputs, out)))
    ref, got = read_metrics(reference), read_metrics(out)
    assert [r["step"] for r in got["train"]] == [r["step"] for r in ref["train"]]
    for a, b in zip(ref["train"], got["train"]):
        assert (a["loss"], a["loss_by_step"]) == (b["loss"], b["loss_by_step"])
    wa = load_file(str(reference / "export" / "model.safetensors"))
    wb = load_file(str(out / "export" / "model.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    leftovers = [p for p in (out / "checkpoints").iterdir() if p.name.startswith(".tmp-")]
    assert not leftovers


def test_sigkill_mid_run_then_rerun_matches_uninterrupted(inputs, reference, tmp_path):
    total = max(r["step"] for r in read_metrics(reference)["train"])
    kill_then_resume(inputs, reference, tmp_path / "run", kill_after_step=min(4, total - 1), extra_delay=0.02)


@pytest.mark.slow
@pytest.mark.parametrize("trial", range(10))
def test_sigkill_sweep(inputs, reference, tmp_path, trial):
    rng = random.Random(trial)
    total = max(r["step"] for r in read_metrics(reference)["train"])
    kill_then_resume(inputs, reference, tmp_path / "run", kill_after_step=rng.randint(1, total - 1),
                     extra_delay=rng.random() * 0.3)
