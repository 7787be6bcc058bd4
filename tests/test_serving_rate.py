"""Which draft serves faster: common/serving_rate.py's output tok/s from per-position rates and
forward times, plan/forward.py's forward times of the user's box, and scripts/bench/arch.py's
command line (pure arithmetic: no model, no server)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from eagle3_testkit.fixtures import REPO_ROOT
from eagle3_train.common import serving_rate as R
from eagle3_train.common.errors import PipelineError
from eagle3_train.plan import forward as F
from eagle3_train.plan.gen import BOX_CURVE, SHORT_CONTEXT

KIMI = json.loads((REPO_ROOT / "docs" / "kimi-k2.5-text-config.json").read_text())
ARCH = REPO_ROOT / "scripts" / "bench" / "arch.py"


def flat(ms: float) -> R.Forward:
    """A forward whose time does not depend on its tokens (memory-bound)."""
    return R.forward([(1, ms), (4096, ms)], "test table")


def geometric(p: float, k: int = 7) -> list[float]:
    return [p ** j for j in range(1, k + 1)]


def test_expected_accepted_sums_the_cumulative_rates():
    rates = [0.9, 0.8, 0.5]
    assert R.expected_accepted(rates, 1) == pytest.approx(0.9)
    assert R.expected_accepted(rates, 3) == pytest.approx(2.2)
    # AL = 1 + E[accepted], as 05 and vLLM count it
    r = R.serve_rate("eagle3", rates, 3, 1, flat(10), flat(1))
    assert r["acceptance_length"] == pytest.approx(3.2)
    assert r["step_ms"] == pytest.approx(10 + 3 * 1) and r["tok_s_seq"] == pytest.approx(3.2 / 13 * 1000)


@pytest.mark.parametrize("arch", R.ARCHS)
@pytest.mark.parametrize("c", [1, 8, 64])
def test_tok_s_rises_with_acceptance_and_steps_cost_more_with_k(arch, c):
    target, draft = F.target_forward(KIMI, F.calibrate(KIMI), 4096), F.draft_forward(KIMI, F.calibrate(KIMI),
                                                                                       "mla", 4096)
    for k in range(1, 8):
        rates = [geometric(p, k) for p in (0.5, 0.7, 0.9, 0.99)]
        tok = [R.serve_rate(arch, r, k, c, target, draft)["tok_s"] for r in rates]
        assert tok == sorted(tok) and len(set(tok)) == len(tok), (k, tok)
    steps = [R.serve_rate(arch, geometric(0.8), k, c, target, draft) for k in range(1, 8)]
    assert [s["verify_ms"] for s in steps] == sorted(s["verify_ms"] for s in steps)
    assert [s["step_ms"] for s in steps] == sorted(s["step_ms"] for s in steps)
    assert all(s["tok_s"] == pytest.approx(c * s["tok_s_seq"]) for s in steps)


def test_eagle3_pays_k_draft_forwards_dflash_one():
    target, draft = flat(10), flat(2)
    e = [R.serve_rate("eagle3", geometric(0.8), k, 4, target, draft)["draft_ms"] for k in (1, 4, 7)]
    d = [R.serve_rate("dflash", geometric(0.8), k, 4, target, draft)["draft_ms"] for k in (1, 4, 7)]
    assert e == [2, 8, 14] and d == [2, 2, 2]


def test_dflash_overtakes_a_better_eagle3_where_its_k_forwards_cost_more_than_its_acceptance_gains():
    """EAGLE-3 accepts more a position (0.95^j against 0.9^j); at K = 1 both run one draft forward and
    EAGLE-3 wins, at K = 7 its 7 forwards cost more than its AL lead and DFlash wins; with a free
    draft forward EAGLE-3 wins at every K."""
    def winner(k, draft_ms):
        rate = {a: R.serve_rate(a, geometric(p), k, 8, flat(10), flat(draft_ms))["tok_s"]
                for a, p in (("eagle3", 0.95), ("dflash", 0.9))}
        return max(rate, key=rate.get)

    assert winner(1, 2.0) == "eagle3" and winner(7, 2.0) == "dflash"
    assert all(winner(k, 1e-6) == "eagle3" for k in range(1, 8))
    # equal rates: DFlash never loses from K = 2 on (one forward instead of K)
    assert all(R.serve_rate("dflash", geometric(0.8), k, 8, flat(10), flat(1))["tok_s"]
               > R.serve_rate("eagle3", geometric(0.8), k, 8, flat(10), flat(1))["tok_s"] for k in range(2, 8))


def test_forward_interpolates_between_points_holds_below_and_extends_beyond():
    f = R.forward([(8, 10), (1, 4), (16, 20)], "t", kv_ms=0.5, kv_per="seq")
    assert f.points == ((1, 4), (8, 10), (16, 20))  # sorted
    assert f.table_ms(0.5) == 4 and f.table_ms(4.5) == pytest.approx(7) and f.table_ms(12) == pytest.approx(15)
    assert f.table_ms(32) == pytest.approx(40)  # the last segment's slope
    assert f.ms(12, 3) == pytest.approx(15 + 1.5)
    assert R.forward([(1, 4), (8, 10)], "t", kv_ms=0.5, kv_per="row").ms(8, 2) == pytest.approx(14)


@pytest.mark.parametrize("points, says", [
    ([], "0 point(s)"),
    ([(1, 3)], "1 point(s)"),
    ([(0, 1), (2, 2)], "(0, 1) is not a positive"),
    ([(1, 2), (4, -1)], "(4, -1) is not a positive"),
    ([(1, 2), (4, float("nan"))], "is not a positive"),
    ([(1, 5), (8, 4)], "8 tokens take 4 ms, less than 1 tokens' 5 ms"),
    ([(1, 2), (1, 3)], "1 tokens given twice"),
    ("fast", "not a table of (tokens, ms) pairs"),
    ([(1, 2, 3), (4, 5, 6)], "not a table of (tokens, ms) pairs"),
])
def test_a_bad_table_is_refused_in_one_line_naming_it(points, says):
    with pytest.raises(PipelineError) as e:
        R.forward(points, "--tables t.json: target")
    msg = str(e.value)
    assert msg.startswith("--tables t.json: target: ") and says in msg and "\n" not in msg


@pytest.mark.parametrize("rates, k, says", [
    ([0.9, 0.8], 3, "K = 3 needs rates for positions 1..3; 2 given"),
    ([0.9, 1.2], 2, "every rate is a share in [0, 1]"),
    ([0.5, 0.8], 2, "must not rise with the position"),
])
def test_bad_rates_are_refused(rates, k, says):
    with pytest.raises(PipelineError, match="eagle3 rates: ") as e:
        R.serve_rate("eagle3", rates, k, 1, flat(10), flat(1))
    assert says in str(e.value)


def test_the_box_model_fits_its_public_decode_figures():
    """calibrate() reproduces the two points it fits (98 tok/s at 1 answer, 1,130 at 32: short context,
    fp8 KV) with a positive fixed cost a layer and a routing share in (0, 1]; the public 16k-context
    figures it was not fitted to (340 tok/s at 8, 490 at 16, bf16 KV assumed) come out within 15%."""
    box = F.calibrate(KIMI)
    assert box.fixed_layer_ms > 0 and 0 < box.routing_share <= 1
    short = F.target_forward(KIMI, F.Box(**{**box.__dict__, "kv_dtype_bytes": 1}), SHORT_CONTEXT)
    for c, tok_s in BOX_CURVE[:2]:
        assert c / short.ms(c, c) * 1000 == pytest.approx(tok_s, rel=1e-6)
    long = F.target_forward(KIMI, box, 16384)
    for c, tok_s in ((8, 340), (16, 490)):
        assert c / long.ms(c, c) * 1000 == pytest.approx(tok_s, rel=0.15)


def test_draft_forwards_follow_plan_drafts_parameter_counts():
    """A DFlash draft of 5 layers reads more than one of 1 and its fixed cost is 6 layers' (5 + its
    fc / lm_head); the MLA EAGLE-3 layer's forward is one layer's fixed cost plus one."""
    box = F.calibrate(KIMI)
    one, five = F.draft_forward(KIMI, box, "dflash", 4096, 1), F.draft_forward(KIMI, box, "dflash", 4096, 5)
    mla = F.draft_forward(KIMI, box, "mla", 4096)
    assert "985M" in one.source and "3,393M" in five.source and "896M" in mla.source
    assert 2 * box.fixed_layer_ms < one.table_ms(1) < five.table_ms(1) and five.table_ms(1) > 6 * box.fixed_layer_ms


def run_arch(*args):
    return subprocess.run([sys.executable, str(ARCH), *args], capture_output=True, text=True, timeout=120)


def test_arch_bench_models_the_measured_figures_and_refuses_a_bad_table(tmp_path):
    out = tmp_path / "rows.json"
    r = run_arch("--concurrency", "1,64", "--ks", "3,7", "--json", str(out))
    assert r.returncode == 0, r.stderr
    rows = json.loads(out.read_text())["rows"]
    assert {(x["group"].split(",")[0], x["family"]) for x in rows} == {
        ("Llama bench target (assets/bench-reasoner)", "dense"), ("DeepSeek-V3 bench target", "kimi"),
        ("Kimi-K2.5 twin", "kimi")}
    assert {x["k"] for x in rows} == {3, 7} and {x["concurrency"] for x in rows} == {1, 64}
    assert r.stdout.count("wins") == 3 * 2
    # the measured AL at K = 3 is what the K = 3 rows carry
    twin = [x for x in rows if x["group"].startswith("Kimi") and x["k"] == 3 and x["arch"] == "dflash"]
    assert twin[0]["acceptance_length"] == pytest.approx(3.453)

    bad = tmp_path / "t.json"
    bad.write_text(json.dumps({"target": {"points": [[1, 5], [8, 4]]}}))
    r = run_arch("--tables", str(bad))
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().count("\n") == 0 and r.stderr.startswith(f"error: --tables {bad}: target: 8 tokens take")
    r = run_arch("--arm", "x:medusa=.9,.8")
    assert r.returncode == 2 and "arch must be one of eagle3, dflash" in r.stderr


def test_arch_bench_reads_05s_report(tmp_path):
    """An arm from 05's report.json: the K sweep's per-position rates at each K, its method the arch."""
    rep = {"k": 7, "method": "dflash", "k_sweep": {"by_k": [
        {"k": 3, "per_position_rate": [0.9, 0.8, 0.7]},
        {"k": 7, "per_position_rate": [0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3]}]}}
    (tmp_path / "report.json").write_text(json.dumps(rep))
    out = tmp_path / "rows.json"
    r = run_arch("--family", "dense", "--report", f"d={tmp_path / 'report.json'}", "--ks", "3,7",
                 "--concurrency", "8", "--json", str(out))
    assert r.returncode == 0, r.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [(x["arch"], x["k"], round(x["acceptance_length"], 3)) for x in rows] == [
        ("dflash", 3, 3.4), ("dflash", 7, 5.2)]
    r = run_arch("--report", f"d={tmp_path / 'missing.json'}")
    assert r.returncode == 2 and "no such file" in r.stderr


def test_arch_bench_takes_measured_forward_times(tmp_path):
    """--tables replaces the modelled forwards of --family's target and drafts: a flat 10 ms verify and
    1 ms draft forwards give EAGLE-3 K x 1 ms and DFlash 1 ms a step."""
    flat_t = {"points": [[1, 10], [4096, 10]]}
    (tmp_path / "t.json").write_text(json.dumps({"target": flat_t, "eagle3": {"points": [[1, 1], [4096, 1]]},
                                                 "dflash": {"points": [[1, 1], [4096, 1]]}}))
    out = tmp_path / "rows.json"
    r = run_arch("--family", "dense", "--tables", str(tmp_path / "t.json"), "--arm", "e:eagle3=.9,.8,.7",
                 "--arm", "d:dflash=.9,.8,.7", "--ks", "3", "--concurrency", "4", "--json", str(out))
    assert r.returncode == 0, r.stderr
    rows = {x["arch"]: x for x in json.loads(out.read_text())["rows"]}
    assert rows["eagle3"]["verify_ms"] == rows["dflash"]["verify_ms"] == 10
    assert rows["eagle3"]["draft_ms"] == 3 and rows["dflash"]["draft_ms"] == 1
    assert rows["dflash"]["speedup"] == pytest.approx(3.4 / 11 * 10)  # no drafting: 1 token a 10 ms step
