"""scripts/gpu_check.py on CPU: what can be checked without a GPU (its steps run only on one)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from helpers import REPO, load_script


@pytest.fixture(scope="module")
def gc():
    return load_script("gpu_check")  # the script is the check: imported as it is run


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


# ----------------------------------------------------------------------------- the device profile

def lock_versions() -> dict[str, str]:
    """name -> version of every package uv.lock pins."""
    import re

    text = (REPO / "uv.lock").read_text()
    return dict(re.findall(r'\[\[package\]\]\nname = "([^"]+)"\nversion = "([^"]+)"', text))


def test_profile_arguments_and_its_budget(gc, tmp_path):
    gp = gc.gpu_profile
    args = gc.parse_args(["--profile", "device", "--out", str(tmp_path)])
    assert args.steps == list(gp.STEPS) and args.budget_s == gp.BUDGET_S
    # the whole profile (its steps' budgets + the imports before them) fits 6 minutes on one H100, so
    # a rerun fits a 15-minute lease
    assert sum(b for b, _ in gp.STEPS.values()) <= gp.BUDGET_S <= 340
    assert set(gp.RUN) == set(gp.STEPS) and gp.VLLM_STEPS <= set(gp.STEPS)
    assert gc.parse_args(["--profile", "device", "--only", "flex,04-mla"]).steps == ["flex", "04-mla"]
    assert gc.parse_args([]).budget_s == 560  # the vLLM check keeps its own
    for bad in (["--profile", "device", "--only", "04"], ["--profile", "gpu"], ["--only", "flex"]):
        with pytest.raises(SystemExit) as e:
            gc.parse_args(bad)
        assert e.value.code == 2
    assert "--profile device --out $OUT/gpu" in gc.__doc__  # the command line, in --help


def test_the_kit_pins_the_repos_versions_and_fits_a_lease_with_the_tree(gc):
    gp = gc.gpu_profile
    pins = lock_versions()
    assert {n: v for n, v, _ in gp.WHEELS} == {n: pins[n] for n, _, _ in gp.WHEELS}
    assert ("speculators", "0.9.0", True) in gp.WHEELS and ("transformers", "5.19.0", True) in gp.WHEELS
    # what the run tool carries: tracked + untracked-not-ignored files, plus the kit (as made, else as
    # measured when it was last made: KIT_BYTES)
    assert gp.kit_bytes() > 10 * 2**20 and gp.tree_bytes() + gp.kit_bytes() <= gp.TREE_LIMIT
    # transformers goes unpacked (it lists models/ at import), pruned to the models the code names
    assert gp.keep_transformers_file("transformers/models/deepseek_v3/modeling_deepseek_v3.py")
    assert gp.keep_transformers_file("transformers/models/__init__.py")
    assert not gp.keep_transformers_file("transformers/models/bert/modeling_bert.py")
    assert gp.keep_transformers_file("transformers/models/bert/configuration_bert.py")
    used = set()
    for root in (REPO / "eagle3-train",):
        for f in root.rglob("*.py"):
            used |= set(__import__("re").findall(r"transformers\.models\.([a-z0-9_]+)", f.read_text()))
    assert used <= set(gp.TRANSFORMERS_MODELS)


@pytest.mark.slow  # makes the kit first where there is none: ~24 MiB of wheels from PyPI
@pytest.mark.e2e
def test_the_kits_wheels_import_as_carried(gc):
    """speculators and the other pure wheels from their zips, transformers from its pruned folder: what
    04's drafts import (the compiled wheels are CPython 3.12's, the image's: this venv's stand in)."""
    kit = gc.gpu_profile.KIT
    if not (kit / "kit.json").exists():
        subprocess.run(["python3", str(REPO / "scripts" / "gpu_check.py"), "--make-kit"], check=True, cwd=REPO)
    code = f"""import sys
sys.path[:0] = {[str(kit / "transformers"), *map(str, sorted(kit.glob("*.whl")))]!r} + [{str(REPO / "eagle3-train")!r}]
from importlib.metadata import version
import eagle3_train.train.draft_mla, eagle3_train.train.draft_dflash, eagle3_train.train.loop
from speculators.models.eagle3 import Eagle3DraftModel
from transformers import DeepseekV3Config, LlamaConfig
import speculators, transformers, datasets
print(version("transformers"), transformers.__file__, speculators.__file__, datasets.__file__)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    ver, tf, spec, ds = out.stdout.split()
    assert ver == "5.19.0" and tf.startswith(str(kit / "transformers"))
    assert ".whl" in spec and ".whl" in ds


def test_bootstrap_puts_the_kit_first_only_where_speculators_is_missing(gc, tmp_path):
    gp = gc.gpu_profile
    kit = tmp_path / "kit"
    (kit / "site").mkdir(parents=True)
    (kit / "transformers").mkdir()
    (kit / "b-1-py3-none-any.whl").write_bytes(b"")
    (kit / "a-1-py3-none-any.whl").write_bytes(b"")
    saved, booted = list(sys.path), gp.BOOTED
    try:
        gp.BOOTED = None
        paths = gp.bootstrap(kit, need_kit=True)
        names = [str(kit / n) for n in ("transformers", "site", "a-1-py3-none-any.whl", "b-1-py3-none-any.whl")]
        assert paths == [str(REPO / "eagle3-train"), *names]
        at = sys.path.index(names[0])  # the kit, in order, before the interpreter's own packages
        assert sys.path[at:at + 4] == names and at < min(i for i, p in enumerate(sys.path) if "-packages" in p)
        assert gp.bootstrap() == paths  # later calls (04's children) get the first call's paths
        sys.path[:] = saved
        gp.BOOTED = None
        assert gp.bootstrap(kit) == [str(REPO / "eagle3-train")]  # speculators imports here: no kit
    finally:
        sys.path[:] = saved
        gp.BOOTED = booted


def test_profile_without_cuda_refuses_in_one_line(gc, tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("on a GPU the profile runs instead of refusing")
    assert gc.main(["--profile", "device", "--out", str(tmp_path / "res")]) == 2
    cap = capsys.readouterr()
    assert cap.out == "" and cap.err.count("\n") == 1 and cap.err.startswith("error: --profile device: no CUDA")
    assert not (tmp_path / "res").exists()


def test_profile_table_says_each_steps_state(gc):
    md = gc.gpu_profile.table({"device": "H100", "torch": "2.11", "steps": {
        "04-mla": {"state": "ok", "wall_s": 40.0, "tokens_per_s": 12000.0, "peak_gib": 20.5},
        "05": {"state": "skipped", "skipped": "no vLLM here"},
        "resume": {"state": "cut", "error": "cut at its budget of 45 s"}}})
    rows = md.splitlines()[4:]
    assert rows[0].startswith("| 04-mla | ok | 40.0 | tokens_per_s 1.2e+04, peak_gib 20.5")
    assert rows[1] == "| 05 | skipped | 0 | no vLLM here |" and "| resume | cut |" in rows[2]


@pytest.mark.e2e
def test_profile_dry_run_runs_every_step_on_cpu(gc, tmp_path):
    """--profile device --dry-run: every step's code at tiny sizes on CPU (all but the CUDA calls)."""
    out = tmp_path / "gpu"
    rc = gc.main(["--profile", "device", "--dry-run", "--out", str(out)])
    res = json.loads((out / "gpu_profile.json").read_text())
    states = {k: v["state"] for k, v in res["steps"].items()}
    assert states == {**{k: "ok" for k in gc.gpu_profile.STEPS}, "02-vllm": "skipped", "05": "skipped"}, \
        {k: v.get("error") for k, v in res["steps"].items()}
    assert rc == 0 and res["ok"] and res["steps"]["05"]["skipped"] == "no vLLM here"
    s = res["steps"]
    assert s["04-eager"]["loss_rel_gap_max"] == 0  # on CPU both runs take sdpa + eager: the same losses
    assert s["resume"]["killed"] and s["resume"]["weights_equal"] and s["fsdp"]["exit_code"] == 0
    assert s["04-mla"]["tokens_per_s"] > 0 and s["04-mla"]["planned_gib"] > 0
    assert "| 04-dflash | ok |" in (out / "gpu_profile.md").read_text()
