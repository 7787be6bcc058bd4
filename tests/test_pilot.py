"""The pilot (eagle3_train/pilot) and the stage driver it shares with scripts/demo.py: a finished
stage is skipped only when its manifest matches this run, another run's is refused (the demo once
reported the Llama demo's AL as the Kimi twin's), each demo profile has its own directory, and
the pilot runs every stage on the tiny target in real vLLM and says its verdict."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
from eagle3_testkit.fixtures import REPO_ROOT
from eagle3_testkit.tiny import write_prompt_file
from eagle3_train.common.config import GENERATE, TOKENIZE
from eagle3_train.common.errors import PipelineError, run_main
from eagle3_train.common.manifest import write_manifest
from eagle3_train.pilot.cli import main as pilot_main
from eagle3_train.pilot.driver import Driver, Output, Step, mismatch
from eagle3_train.pilot.stage import AL_NONE

PILOT = REPO_ROOT / "eagle3-train" / "pilot.py"


def fake_01b(out: Path, **config) -> Path:
    """A finished 01b directory (only its manifest) made with `config`."""
    out.mkdir(parents=True, exist_ok=True)
    write_manifest(out, GENERATE, config=config, counts={"requested": 300})
    return out


# ----------------------------------------------------------------------------- the driver

def test_mismatch_reads_the_manifest_and_names_the_first_difference(tmp_path):
    d = fake_01b(tmp_path / "01b", tokenizer=str(tmp_path / "llama"), max_tokens=320, temperature=0.0)
    assert mismatch(Output(d, GENERATE, {"config.tokenizer": tmp_path / "llama", "config.max_tokens": 320,
                                         "config.temperature": 0, "counts.requested": 300})) is None
    why = mismatch(Output(d, GENERATE, {"config.tokenizer": tmp_path / "kimi-twin"}))
    assert why == f"config.tokenizer is '{tmp_path / 'llama'}' there, '{tmp_path / 'kimi-twin'}' in this run"
    assert "counts.requested is 300 there, 600" in mismatch(Output(d, GENERATE, {"counts.requested": 600}))
    assert "config.limit is None there" in mismatch(Output(d, GENERATE, {"config.limit": 64}))
    # no complete output: nothing to compare (the stage itself resumes or refuses)
    assert mismatch(Output(tmp_path / "absent", GENERATE, {"config.limit": 64})) is None
    (tmp_path / "half").mkdir()
    assert mismatch(Output(tmp_path / "half", GENERATE, {"config.limit": 64})) is None


def test_the_driver_skips_a_matching_stage_and_refuses_another_runs(tmp_path, capsys):
    d = fake_01b(tmp_path / "01b", tokenizer="/models/llama")
    drv = Driver(tmp_path, "demo", flag="--out", summary=tmp_path / "summary.json")
    ran = []
    same = Step("01b_generate_synthetic", "answers", lambda: ran.append(1),
                (Output(d, GENERATE, {"config.tokenizer": "/models/llama"}),))
    assert drv.run(1, 2, same) == "skipped" and ran == []
    assert "01b_generate_synthetic already complete" in capsys.readouterr().out
    other = Step("01b_generate_synthetic", "answers", lambda: ran.append(1),
                 (Output(d, GENERATE, {"config.tokenizer": "/models/kimi-twin"}),))
    with pytest.raises(PipelineError, match=r"01b holds another run's 01b_generate_synthetic output \("
                                            r"config.tokenizer is '/models/llama' there, '/models/kimi-twin' "
                                            r"in this run\); pass another --out"):
        drv.preflight([same, other])
    assert ran == []
    # a stage with an unfinished output runs, and its time is kept in the summary
    todo = Step("04_train", "train", lambda: ran.append(1), (Output(tmp_path / "04", TOKENIZE),))
    assert drv.run(2, 2, todo) == "done" and ran == [1]
    assert set(json.loads((tmp_path / "summary.json").read_text())["stages_s"]) == {"04"}


def _demo():
    sys.path.insert(0, str(REPO_ROOT / "scripts"))  # the demo is a script: imported as it is run
    try:
        return importlib.import_module("demo")
    finally:
        sys.path.remove(str(REPO_ROOT / "scripts"))


def test_each_demo_profile_has_its_own_directory():
    demo = _demo()
    outs = {tuple(argv): demo.parse_args(argv).out for argv in
            ([], ["--quick"], ["--kimi-twin"], ["--kimi-twin", "--quick"], ["--target", "/m/qwen3"])}
    assert outs[()] == REPO_ROOT / "runs" / "demo"  # the README's runs/demo/05/report.md
    assert outs[("--kimi-twin", "--quick")] == REPO_ROOT / "runs" / "demo-kimi-twin-quick"
    assert outs[("--target", "/m/qwen3")] == REPO_ROOT / "runs" / "demo-qwen3"
    assert len(set(outs.values())) == len(outs)
    assert demo.parse_args(["--kimi-twin", "--out", "/x"]).out == Path("/x")


def test_the_demo_refuses_another_profiles_finished_stage_before_writing(tmp_path, tiny_reasoner_dir):
    """What `--kimi-twin --quick` after `bash scripts/demo.sh` in one --out met: another target's
    finished 01b. Refused in one line naming --out, before the prompts are rewritten."""
    out = tmp_path / "demo"
    fake_01b(out / "01b", input=str(out / "prompts" / "train.jsonl"), tokenizer="/elsewhere/kimi-twin",
             max_tokens=320)
    r = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "demo.py"), "--quick", "--out", str(out)],
                       capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.strip().splitlines() == [
        f"error: {out / '01b'} holds another run's 01b_generate_synthetic output (config.tokenizer is "
        f"'/elsewhere/kimi-twin' there, {str(tiny_reasoner_dir.resolve())!r} in this run); pass another --out, "
        f"or move {out / '01b'} aside"]
    assert not (out / "prompts").exists()


# ----------------------------------------------------------------------------- the pilot's CLI

RUN = ["--target", "t", "--input", "p", "--work-dir", "w"]


@pytest.mark.parametrize("argv,message", [
    (["--target", "t", "--work-dir", "w"], "--input is required"),
    ([*RUN, "--base-url", "http://h:8000/v1"], "--base-url needs --model"),
    ([*RUN, "--stage-arg", "06:--x=1"], "--stage-arg '06:--x=1'"),
    ([*RUN, "--stage-arg", "04:fsdp"], "--stage-arg '04:fsdp'"),
    ([*RUN, "--budget", "soon"], "--budget must be"),
    ([*RUN, "--pilot-prompts", "0"], "--pilot-prompts must be"),
    ([*RUN, "--startup-timeout", "0"], "--startup-timeout must be positive, not 0.0"),
])
def test_bad_flags_are_one_error_line(argv, message, capsys):
    assert run_main(pilot_main, argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


def test_a_missing_target_or_input_is_refused_before_any_stage(tmp_path, tiny_reasoner_dir, capsys):
    prompts = tmp_path / "p.jsonl"
    write_prompt_file(prompts, 4, 1)
    base = ["--input", str(prompts), "--work-dir", str(tmp_path / "w"), "--extract-backend", "hf"]
    assert run_main(pilot_main, ["--target", str(tmp_path / "nothing"), *base]) == 2
    assert "--target" in capsys.readouterr().err
    # 4 prompts, 64 for the pilot: none left for 05
    assert run_main(pilot_main, ["--target", str(tiny_reasoner_dir), *base]) == 2
    assert "none left after the pilot's 64 for 05: pass --heldout" in capsys.readouterr().err
    assert not (tmp_path / "w" / "pilot" / "01b").exists()


def test_the_shim_and_a_torch_free_cli():
    code = [ln for ln in PILOT.read_text().splitlines() if ln.strip() and not ln.startswith(("#", '"""'))]
    assert code == ["from eagle3_train.pilot.cli import entry", "entry()"]
    out = subprocess.run([sys.executable, "-c", "import sys, eagle3_train.pilot.cli, eagle3_train.pilot.config, "
                          "eagle3_train.pilot.driver; print('torch' in sys.modules)"],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr


def test_screen_only_exits_1_on_garbled_answers(tmp_path, capsys):
    raw = tmp_path / "gen"
    raw.mkdir()
    rec = {"messages": [{"role": "user", "content": "hi"}], "reasoning": None, "content": "x" * 50,
           "prompt_token_ids": [1, 2], "token_ids": list(range(100, 164)), "finish_reason": "length"}
    (raw / "raw_responses.jsonl").write_text("".join(json.dumps({"id": f"q{i}", **rec}) + "\n" for i in range(8)))
    assert run_main(pilot_main, ["--screen-only", str(raw)]) == 1
    out = capsys.readouterr().out
    assert "screen of 8 answers: GARBLED" in out and "ended" in out and "reasoning check is skipped" in out


# ----------------------------------------------------------------------------- the pilot, end to end

@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_the_pilot_on_the_tiny_target(tmp_path, tiny_reasoner_dir):
    """16 prompts -> 01b in a vLLM launched for it -> screen -> 02 (hf) -> 03 -> 04 (10 steps) -> 05 on
    4 held-out prompts in vLLM: every stage ok, the screen ok, a draft vLLM accepts; rerun: all skipped."""
    prompts = tmp_path / "prompts.jsonl"
    write_prompt_file(prompts, 20, 1)

    def pilot(budget: str = "10", timeout: int = 300):
        cmd = [sys.executable, str(PILOT), "--target", str(tiny_reasoner_dir), "--input", str(prompts),
               "--work-dir", str(tmp_path / "w"), "--pilot-prompts", "16", "--budget", budget, "--eval-prompts", "4",
               "--extract-backend", "hf", "--max-model-len", "1024", "--max-tokens", "320", "--temperature", "0"]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT)

    r = pilot(timeout=800)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    out = tmp_path / "w" / "pilot"
    rep = json.loads((out / "pilot_report.json").read_text())
    assert rep["verdict"] == "ok" and rep["reasons"] == []
    assert [(s["stage"], s["status"]) for s in rep["stages"]] == [
        ("01b", "ok"), ("screen", "ok"), ("02", "ok"), ("03", "ok"), ("04", "ok"), ("05", "ok")]
    assert rep["screen"]["answers"] == 16 and rep["screen"]["length"]["at_max_tokens"] == 0
    # Measured 1.13 in vLLM (1.12 offline) after 10 steps; a broken link gives 1.00.
    assert rep["acceptance_length"]["vllm"] > AL_NONE and rep["acceptance_length"]["k"] == 3
    assert "acceptance length" in (out / "pilot_report.md").read_text()
    assert json.loads((out / "04" / "manifest.json").read_text())["counts"]["steps"] == 10

    r2 = pilot()
    assert r2.returncode == 0 and r2.stdout.count("already complete") == 5, r2.stdout[-3000:]
    rep2 = json.loads((out / "pilot_report.json").read_text())
    assert all(s["earlier_run"] for s in rep2["stages"] if s["stage"] != "screen")
    assert rep2["stages_s"] == rep["stages_s"] | {"screen": rep2["stages_s"]["screen"]}

    # Another run's settings in the same --work-dir: refused before anything runs.
    r3 = pilot(budget="12")
    assert r3.returncode == 2 and "(config.budget is '10' there, '12' in this run); pass another --work-dir" \
        in r3.stderr, r3.stderr
