"""The pilot (eagle3_train/pilot) and the stage driver it shares with scripts/demo.py: a finished
stage is skipped only when its manifest matches this run, another run's is refused (the demo once
reported the Llama demo's AL as the Kimi twin's), each demo profile has its own directory, and
the pilot runs every stage on the tiny target in real vLLM and says its verdict."""

from __future__ import annotations

import hashlib
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
from helpers import load_script

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
    return load_script("demo")  # the demo is a script: imported as it is run


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
    ([*RUN, "--concurrency", "lots"], "--concurrency must be auto or a positive number, not 'lots'"),
    ([*RUN, "--concurrency", "0"], "--concurrency must be at least 1, not 0"),
    ([*RUN, "--samples", "0"], "--samples must be at least 1, not 0"),
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
    assert "none left after the pilot's 64 for 05: pass --heldout-prompts" in capsys.readouterr().err
    assert not (tmp_path / "w" / "pilot" / "01b").exists()


def test_05s_prompts_are_held_out_of_what_01b_answers(tmp_path):
    """--input not a split: --eval-prompts of the first --pilot-prompts + --eval-prompts are held out
    by the split's rule and 01b answers the others; a split's train.jsonl: its heldout.jsonl;
    --heldout-prompts (or the older --heldout): taken unless 01b would answer one of its ids."""
    from eagle3_train.common.prompts import load_prompts
    from eagle3_train.common.split import pick_heldout
    from eagle3_train.pilot.cli import parse_args
    from eagle3_train.pilot.stage import pilot_prompts
    from eagle3_train.split_prompts.cli import main as split_main

    src = write_prompt_file(tmp_path / "p.jsonl", 20, 1)
    ids = load_prompts(str(src)).ids

    def cfg(*extra):
        return parse_args(["--target", "t", "--input", str(src), "--work-dir", str(tmp_path / "w"),
                           "--pilot-prompts", "6", "--eval-prompts", "3", *extra])

    own = pilot_prompts(cfg(), tmp_path / "prompts")
    assert own.input == str(tmp_path / "prompts" / "train.jsonl")
    assert own.heldout == tmp_path / "prompts" / "heldout.jsonl"
    assert not own.heldout.exists()  # written by the pilot after its preflight, not here
    train = [json.loads(ln)["id"] for ln in own.texts["train.jsonl"].splitlines()]
    held = [json.loads(ln)["id"] for ln in own.texts["heldout.jsonl"].splitlines()]
    assert set(held) == pick_heldout(ids[:9], 3) and train == [i for i in ids[:9] if i not in set(held)]
    assert own.sha256 == hashlib.sha256(own.texts["train.jsonl"].encode()).hexdigest()

    assert run_main(split_main, ["--input", str(src), "--heldout", "4", "--output-dir", str(tmp_path / "split")]) == 0
    split_train = tmp_path / "split" / "train.jsonl"
    chosen = pilot_prompts(parse_args(["--target", "t", "--input", str(split_train), "--work-dir", "w"]), tmp_path)
    assert (chosen.input, chosen.heldout, chosen.texts) == (str(split_train), tmp_path / "split" / "heldout.jsonl", {})

    other = write_prompt_file(tmp_path / "other.jsonl", 2, 7)
    chosen = pilot_prompts(cfg("--heldout", str(other)), tmp_path / "prompts")  # the older spelling
    assert (chosen.input, chosen.heldout, chosen.texts) == (str(src), other, {})
    with pytest.raises(PipelineError, match=rf"1 of 2 --heldout-prompts ids are among the 6 prompts of --input that "
                                            rf"01b answers \(e.g. '{ids[5]}'\)"):
        clash = tmp_path / "clash.jsonl"
        clash.write_text(other.read_text().splitlines()[0] + "\n" + src.read_text().splitlines()[5] + "\n")
        pilot_prompts(cfg("--heldout-prompts", str(clash)), tmp_path / "prompts")


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


# ----------------------------------------------------------------------------- 01b's measured rates

def fake_answers(d: Path, lengths: list[int], start: str = "2026-12-05T10:00:00+00:00", latency: float = 10.0):
    """raw_responses.jsonl of answers that each took `latency` s, all in flight at once, ending `start` + latency."""
    import datetime as dt

    end = (dt.datetime.fromisoformat(start) + dt.timedelta(seconds=latency)).isoformat()
    d.mkdir(parents=True, exist_ok=True)
    (d / "raw_responses.jsonl").write_text("".join(json.dumps(
        {"id": f"q{i}", "prompt_token_ids": [1] * 100, "token_ids": [7] * n, "created": end, "latency_s": latency})
        + "\n" for i, n in enumerate(lengths)))


# 01b --concurrency auto's manifest history (t, level, kv, running, waiting, preemptions, tok_s): a window's
# answers running are the mean of its two readings, 4 and 7 at level 8 (5.5), 11 at level 16
HISTORY = [
    {"t": 2.0, "level": 8, "kv": 0.1, "running": 0, "waiting": 0, "preemptions": 0, "tok_s": None},
    {"t": 4.0, "level": 8, "kv": 0.3, "running": 8, "waiting": 0, "preemptions": 0, "tok_s": 300.0},
    {"t": 6.0, "level": 8, "kv": 0.4, "running": 6, "waiting": 0, "preemptions": 0, "tok_s": 260.0},
    {"t": 8.0, "level": 16, "kv": 0.8, "running": 16, "waiting": 0, "preemptions": 0, "tok_s": 500.0},
]


def test_the_rates_come_from_autos_history_else_the_fixed_levels_busy_time(tmp_path):
    from eagle3_train.pilot.rates import busy_rate, gen_rates, history_points

    assert history_points(HISTORY) == [
        {"level": 5.5, "auto_level": 8, "tok_s": 280.0, "windows": 2,
         "how": "auto: the controller's windows at this level"},
        {"level": 11.0, "auto_level": 16, "tok_s": 500.0, "windows": 1,
         "how": "auto: the controller's windows at this level"}]
    d = tmp_path / "01b"
    fake_answers(d, [100, 300, 2000, 1600])
    manifest = {"config": {"concurrency": "auto", "max_tokens": 4096}, "this_run": {
        "server_cache": {"endpoints": {"http://h/v1": {"cache_tokens": 50000}}},
        "concurrency": {"setting": "auto", "endpoints": {"http://h/v1": {"mode": "auto", "history": HISTORY}}}}}
    r = gen_rates(d, manifest, ["--kv-cache-dtype=fp8"])
    assert [p["level"] for p in r["points"]] == [5.5, 11.0] and r["cache_tokens"] == 50000
    a = r["answers"]
    assert (a["count"], a["mean"], a["p50"], a["max"]) == (4, 1000, 300, 2000)
    assert r["answers"]["resident"] == round((100 ** 2 + 300 ** 2 + 2000 ** 2 + 1600 ** 2) / 8000, 1)
    assert (r["prompt_tokens"], r["max_tokens"], r["kv_cache_dtype"], r["dcp"]) == (100, 4096, "fp8", 1)
    # a fixed level: 4 answers in flight for the same 10 s, 4,000 tokens: 400 tok/s at 4
    fixed = gen_rates(d, {"config": {"concurrency": 4}, "this_run": {"concurrency": {"setting": 4}}})
    assert fixed["points"] == [{"level": 4.0, "tok_s": 400.0, "seconds": 10.0, "concurrency": 4,
                                "how": "fixed: generated tokens over the time answers were in flight"}]
    # a resumed run's pause is not time in flight: two 10 s bursts an hour apart
    recs = [{"created": "2026-12-05T10:00:10+00:00", "latency_s": 10, "token_ids": [1] * 100},
            {"created": "2026-12-05T11:00:10+00:00", "latency_s": 10, "token_ids": [1] * 100}]
    assert busy_rate(recs) == {"level": 1.0, "tok_s": 10.0, "seconds": 20.0,
                               "how": "fixed: generated tokens over the time answers were in flight"}
    assert busy_rate([{"token_ids": [1]}]) is None


def test_the_pilot_writes_gen_rates_and_plans_the_full_run_from_them(tmp_path):
    """What the pilot's report says after 01b: gen_rates.json where 00_plan finds it (--work-dir), and
    the full run's 01b from the planner's plan() with the measured points, lengths and cache."""
    from eagle3_train.pilot.cli import parse_args
    from eagle3_train.pilot.stage import format_report, measure_01b
    from eagle3_train.plan import planner

    target = REPO_ROOT / "docs" / "kimi-k2.5-text-config.json"
    prompts = tmp_path / "p.jsonl"
    write_prompt_file(prompts, 30, 1)
    cfg = parse_args(["--target", str(target), "--input", str(prompts), "--work-dir", str(tmp_path / "w"),
                      "--samples", "25000", "--max-tokens", "4096", "--tensor-parallel-size", "8"])
    assert cfg.concurrency == "auto"
    out = tmp_path / "w" / "pilot"
    assert measure_01b(cfg, out) is None  # 01b not finished: nothing measured
    fake_answers(out / "01b", [100, 300, 2000, 1600])
    write_manifest(out / "01b", GENERATE, config={"concurrency": "auto", "max_tokens": 4096}, counts={}, this_run={
        "server_cache": {"endpoints": {"u": {"cache_tokens": 215590}}},
        "concurrency": {"setting": "auto", "endpoints": {"u": {"history": HISTORY}}}})
    full = measure_01b(cfg, out)
    rates = json.loads((out / "gen_rates.json").read_text())
    assert [p["tok_s"] for p in rates["points"]] == [280.0, 500.0] and rates["answers"]["count"] == 4
    typical = 100 + rates["answers"]["resident"]
    level = min(256, int(215590 // typical))
    rate = planner.G.gen_tok_s(level, round(typical), [(5.5, 280.0), (11.0, 500.0)])
    assert full["samples"] == 25000 and full["samples_from"] == "--samples" and full["concurrency"] == level
    assert full["tok_s"] == round(rate, 1) and full["hours"] == round(25000 * 1000 / rate / 3600, 2)
    assert "measured (the pilot's 01b): 280 at 5.5, 500 at 11 tok/s" in full["rate_source"]
    md = format_report({"target": "t", "input": "i", "sizes": {"pilot_prompts": 4, "budget": "20", "eval_prompts": 2},
                        "stages": [], "verdict": "ok", "reasons": [], "screen": {}, "acceptance_length": {},
                        "full_run_01b": full})
    assert f"25,000 prompts (--samples): 01b {full['hours']:,.1f} h at {full['tok_s']:,.0f} tok/s, " \
           f"--concurrency auto ~{level}." in md
    assert "01b KV cache 215,590 tokens a server (measured: 01b's /metrics)" in md
    # 00_plan finds the same file under --work-dir
    plan = planner.flags_from(planner_config(target, tmp_path / "w"))
    assert plan.gen_points == [(5.5, 280.0), (11.0, 500.0)] and plan.cache_tokens == 215590
    # without --samples: the prompts of --input; answers without ids: one line in the report, no file
    cfg2 = parse_args(["--target", str(target), "--input", str(prompts), "--work-dir", str(tmp_path / "w")])
    assert measure_01b(cfg2, out)["samples"] == 30
    fake_answers(out / "01b", [0, 0])
    assert "no answer with tokens" in measure_01b(cfg2, out)["error"]


def planner_config(target: Path, work_dir: Path):
    from eagle3_train.plan.cli import parse_args

    return parse_args(["--target", str(target), "--work-dir", str(work_dir), "--gpu-memory-gb", "96"])


# ----------------------------------------------------------------------------- the pilot, end to end

@pytest.mark.slow  # tests/test_runbook.py runs the same pilot in the default suite (its step 3)
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
    # 01b ran at --concurrency auto (the pilot's default): its rates and lengths measured for 00_plan
    rates = json.loads((out / "gen_rates.json").read_text())
    assert rates["concurrency"] == "auto" and rates["answers"]["count"] == 16 and rates["cache_tokens"] > 0
    assert rates["points"] and all(p["level"] > 0 and p["tok_s"] > 0 for p in rates["points"])
    assert "## 01b of the full run, from the pilot's measured rates" in (out / "pilot_report.md").read_text()
    assert rep["full_run_01b"]["samples"] == 20 and rep["full_run_01b"]["samples_from"] == "the prompts of --input"
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
