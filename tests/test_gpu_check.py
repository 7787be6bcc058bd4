"""scripts/gpu_check.py on CPU: what can be checked without a GPU (its steps run only on one)."""

from __future__ import annotations

import importlib
import sys

import pytest
import torch
from helpers import REPO


@pytest.fixture(scope="module")
def gc():
    sys.path.insert(0, str(REPO / "scripts"))  # the script is the check: it is imported as it is run
    try:
        return importlib.import_module("gpu_check")
    finally:
        sys.path.remove(str(REPO / "scripts"))


def test_arguments_and_their_defaults(gc, tmp_path):
    args = gc.parse_args(["--out", str(tmp_path)])
    assert args.steps == ["02-twin", "04", "05"] and args.budget_s == 560 and args.train_steps == 30
    assert sum(gc.STEPS[s][0] for s in args.steps) <= args.budget_s <= 600  # the default check fits 10 min
    assert gc.STEPS["04-width"][0] <= args.budget_s  # and so does the width step alone
    assert gc.parse_args(["--only", "05, 04"]).steps == ["05", "04"]
    assert set(gc.RUN) == set(gc.STEPS)  # every listed step has its function
    assert gc.parse_args(["--device", "cpu", "--only", "02-twin"]).device == "cpu"
    assert gc.parse_args(["--device", "cpu", "--only", "04-width", "--width", "320"]).width == 320
    assert gc.parse_args(["--device", "cpu", "--only", "02,02-twin"]).steps == ["02", "02-twin"]
    assert gc.parse_args(["--only", "02,mla"]).mla_steps == 40  # the former gpu_check_0N.py, by name
    assert gc.parse_args(["--only", "mla-flex"]).steps == ["mla-flex"] and gc.STEPS["mla-flex"][0] <= args.budget_s
    assert gc.parse_args(["--only", "dflash"]).steps == ["dflash"] and gc.STEPS["dflash"][0] <= args.budget_s
    for bad in (["--only", "03"], ["--only", ","], ["--budget-s", "soon"], ["--device", "cpu"],
                ["--device", "cpu", "--only", "mla"]):
        with pytest.raises(SystemExit) as e:
            gc.parse_args(bad)
        assert e.value.code == 2


def test_dry_run_lists_the_steps_without_a_gpu(gc, tmp_path, capsys):
    assert gc.main(["--dry-run", "--out", str(tmp_path), "--only", "02-twin,05"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("gpu_check: 2 step(s), budget 560 s") and str(tmp_path / "gpu_check.json") in out[0]
    assert [ln.split()[0] for ln in out[1:]] == ["02-twin", "05"]
    assert "02 --backend vllm" in out[1] and not list(tmp_path.iterdir())


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the check runs instead of refusing")
def test_without_cuda_it_refuses_in_one_line_and_writes_nothing(gc, tmp_path, capsys):
    assert gc.main(["--out", str(tmp_path / "res")]) == 2
    cap = capsys.readouterr()
    assert cap.out == "" and cap.err.count("\n") == 1 and cap.err.startswith("error: no CUDA device")
    assert not (tmp_path / "res").exists()
