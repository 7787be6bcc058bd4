"""04_train under torchrun with 2 CPU processes on gloo: DDP follows the same trajectory as one
process accumulating the same two batches per step; FSDP (slow suite) follows DDP."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from eagle3_train.common.vllm_server import free_port
from eagle3_train.train import run
from eagle3_train.train.checkpoint import checkpoints
from eagle3_train.train.metrics import read_metrics
from helpers import inputs_argv, script_path, stage_cli
from helpers_train import train_inputs
from safetensors.torch import load_file

pytestmark = pytest.mark.e2e  # stage processes, kill -9, real files: the slow part of the suite

SCRIPT = script_path("04_train")
stage = stage_cli("04_train")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, llama_target_dir):
    return train_inputs(tmp_path_factory.mktemp("dist"), llama_target_dir, n=20, shard_size=7)


def argv(inputs, out, *extra):
    return inputs_argv(inputs, out, *extra, max_tokens_per_batch=192, save_every=2, threads=None)


def torchrun(inputs, out, *extra) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(SCRIPT),
           *argv(inputs, out, *extra)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.fixture(scope="module")
def accumulated(inputs):
    """One process, two batches per step (what two DDP ranks see together)."""
    out = inputs["root"] / "accum"
    run(stage.parse_args(argv(inputs, out, "--grad-accum", "2", "--threads", "1")))
    return out


def same_trajectory(a: Path, b: Path, rtol: float) -> None:
    ma, mb = read_metrics(a), read_metrics(b)
    assert [r["step"] for r in ma["train"]] == [r["step"] for r in mb["train"]]
    for x, y in zip(ma["train"], mb["train"]):
        assert x["tokens"] == y["tokens"]  # the same batches
        assert x["loss"] == pytest.approx(y["loss"], rel=rtol)
        assert x["loss_by_step"] == pytest.approx(y["loss_by_step"], rel=rtol)
    for x, y in zip(ma["val"], mb["val"]):
        assert x["drafts"] == y["drafts"]
        assert x["by_position"] == y["by_position"]  # summed over ranks as the rest (all-reduced)
        assert x["loss"] == pytest.approx(y["loss"], rel=rtol)
    wa = load_file(str(a / "export" / "model.safetensors"))
    wb = load_file(str(b / "export" / "model.safetensors"))
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=rtol, atol=rtol * 1e-2)


def test_ddp_two_processes_match_gradient_accumulation(inputs, accumulated):
    out = inputs["root"] / "ddp"
    torchrun(inputs, out)
    same_trajectory(accumulated, out, rtol=1e-4)
    man = read_metrics(out)
    assert len(man["train"]) >= 2 and checkpoints(out)
    assert sorted(p.name for p in (checkpoints(out)[-1][1] / "rng").iterdir()) == \
        ["rank-00000.pt", "rank-00001.pt"]


@pytest.mark.slow
def test_fsdp_two_processes_match_gradient_accumulation(inputs, accumulated):
    out = inputs["root"] / "fsdp"
    torchrun(inputs, out, "--distributed", "fsdp")
    same_trajectory(accumulated, out, rtol=1e-4)
