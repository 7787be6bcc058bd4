"""Acceptance under sampled serving (temperature > 0): acceptance.py's sampled walk (a proposal
accepted with the target's probability of it, as vLLM verifies a greedy draft), 05 offline's use of
it (the probabilities in the right frame), 04's --val-temperature, and their bad inputs."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from eagle3_train.common.acceptance import (
    chain_acceptance,
    proposal_probs,
    sampled_acceptance,
    sampled_walk,
    sampling_probs,
    summarize,
)
from eagle3_train.common.hidden_store import HiddenStates
from helpers import SampleStore
from helpers_draft import make_greedy_store, make_random_draft
from reliability import assert_one_error_line, run_inprocess  # noqa: F401

K = 3


def all_valid(k: int, n: int) -> torch.Tensor:
    """valid [k, n] of one fully supervised sequence: step k at t needs t+1+k < n."""
    t = torch.arange(n)
    return torch.stack([t + 1 + j < n for j in range(k)])


def walk_al(p: torch.Tensor, valid: torch.Tensor, draws: int, seed: int = 0) -> float:
    counts, _ = sampled_acceptance(p, valid, draws, torch.Generator().manual_seed(seed))
    return summarize(counts)["acceptance_length"]


def test_sampled_walk_with_certain_acceptance_is_the_greedy_walk():
    valid = all_valid(K, 200)
    valid[:, 50:60] = False  # a hole: the walk restarts after it, in both
    counts, per_draw = sampled_acceptance(torch.ones(K, 200), valid, 4, torch.Generator().manual_seed(0))
    greedy = chain_acceptance(valid.clone(), valid)
    assert counts["drafts"] == 4 * greedy["drafts"] and counts["accepted"] == 4 * greedy["accepted"]
    assert summarize(counts)["acceptance_length"] == pytest.approx(summarize(greedy)["acceptance_length"])
    assert per_draw.tolist() == [[greedy["drafts"], greedy["accepted"]]] * 4


def test_sampled_walk_with_no_acceptance_is_one():
    assert walk_al(torch.zeros(K, 300), all_valid(K, 300), 8) == 1.0


@pytest.mark.parametrize("p", [0.3, 0.6, 0.9])
def test_sampled_walk_with_a_constant_probability_meets_the_closed_form(p):
    """Independent steps: E[accepted] = p + p^2 + ... + p^K per draft, wherever the walk drafts.
    Seeded, so the figure is fixed; 60,000+ drafts put its Monte-Carlo error near 0.004."""
    al = walk_al(torch.full((K, 4000), p), all_valid(K, 4000), 32)
    assert al == pytest.approx(1 + sum(p ** (k + 1) for k in range(K)), abs=0.015)


def test_sampled_walk_draws_until_its_error_is_small_and_is_seeded():
    parts = [(torch.full((K, 150), 0.5), all_valid(K, 150), None) for _ in range(3)]
    counts, mc = sampled_walk(parts, seed=7, repeats=4, target_se=0.01)
    assert mc["walk_se"] < 0.01 and mc["repeats"] > 4  # 4 draws of 450 tokens are too few
    again, mc2 = sampled_walk(parts, seed=7, repeats=4, target_se=0.01)
    assert again == counts and mc2 == mc
    # below the closed form 1.875 by the drafts cut short at each sequence's end (counted rejected)
    assert 1.8 < summarize(counts)["acceptance_length"] < 1.875


def test_sampled_walk_counts_by_position():
    n = 700
    counts, _ = sampled_acceptance(torch.full((K, n), 0.5), all_valid(K, n), 4, torch.Generator().manual_seed(1),
                                   torch.arange(n) + 2, (0, 512))
    by = counts["by_position"]
    assert sum(by["drafts"]) == counts["drafts"] and sum(by["accepted"]) == counts["accepted"]
    assert by["drafts"][0] > 0 and by["drafts"][1] > 0


def test_sampling_probs_applies_temperature_and_top_p_as_vllm():
    logits = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.15), math.log(0.05)]])
    assert sampling_probs(logits, 1.0).tolist()[0] == pytest.approx([0.5, 0.3, 0.15, 0.05])
    # top-p 0.8, vLLM's rule: ascending cumulative mass 0.05, 0.2, 0.5, 1.0; those <= 0.2 dropped
    assert sampling_probs(logits, 1.0, 0.8).tolist()[0] == pytest.approx([0.625, 0.375, 0, 0])
    assert sampling_probs(logits, 0.5).tolist()[0] == pytest.approx(
        (torch.tensor([0.5, 0.3, 0.15, 0.05]) ** 2 / (0.25 + 0.09 + 0.0225 + 0.0025)).tolist())


def test_proposal_probs_reads_row_t_plus_k_in_chunks_and_from_top_k():
    torch.manual_seed(0)
    n, v = 50, 11
    logits = torch.randn(n, v)
    drafts = [torch.randint(0, v, (n,)) for _ in range(K)]
    drafts[1][5] = -1  # no proposal
    p = proposal_probs(drafts, lambda a, b: (logits[a:b], None), 1.0, chunk=7)
    probs = logits.softmax(-1)
    for k in range(K):
        for t in range(n - k):
            want = 0.0 if drafts[k][t] < 0 else float(probs[t + k, drafts[k][t]])
            assert float(p[k, t]) == pytest.approx(want, abs=1e-6)
    top, ids = logits.topk(4, -1)  # a stored top-k: renormalised over its 4 tokens
    q = proposal_probs(drafts, lambda a, b: (top[a:b].log_softmax(-1), ids[a:b]), 1.0, chunk=9)
    t, k = 3, 2
    inside = (ids[t + k] == drafts[k][t]).any()
    assert float(q[k, t]) == pytest.approx(float(top[t + k].softmax(-1)[ids[t + k] == drafts[k][t]].sum())
                                           if inside else 0.0, abs=1e-6)


# ----------------------------------------------------------------------------- 05 offline


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory, llama_target_dir):
    return make_greedy_store(tmp_path_factory.mktemp("store") / "hidden", llama_target_dir, n=4)


def test_offline_sampled_probabilities_are_the_targets_at_the_proposed_positions(store_dir, llama_target_dir,
                                                                               tmp_path):
    """Each p must be the target's softmax (a transformers forward) of the draft's proposal where vLLM
    verifies it: frame position t (token t + 1 in) proposes token t + 2 + k at step k, verified in
    the target's row t + 1 + k; the offline walk then uses them, seeded."""
    from transformers import AutoModelForCausalLM

    from eagle3_train.evaluate.draft import load_draft, load_target_head
    from eagle3_train.evaluate.offline import accept_probs, draft_step_tokens, offline_eval

    store = HiddenStates(store_dir)
    head = load_target_head(llama_target_dir)
    draft = load_draft(make_random_draft(tmp_path / "draft", llama_target_dir, k=K), llama_target_dir)
    s = store.get(store.ids[0])
    d = draft_step_tokens(draft, [s], K)[0]
    p = accept_probs(s, d, head, 0.7, 1.0)
    model = AutoModelForCausalLM.from_pretrained(llama_target_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        probs = (model(s.input_ids[None]).logits[0] / 0.7).softmax(-1)
    n = s.input_ids.shape[0] - 1
    # the oracle (reach): the target's greedy token at every depth, so its p is the row's largest
    same, reach = accept_probs(s, d, head, 0.7, 1.0, greedy=head.greedy(s.last)[1:])
    assert torch.equal(same, p)
    for k in range(K):
        t = torch.arange(n - 1 - k)
        assert torch.allclose(p[k, t], probs[t + 1 + k, d[k][t]], atol=1e-5)
        assert torch.allclose(reach[k, t], probs[t + 1 + k].max(-1).values, atol=1e-5)
    res = offline_eval(draft, head, store, store.ids, K, temperature=0.7, seed=3)
    assert res["walk"] == "sampled" and res["walk_se"] < 0.01 and res["repeats"] >= 32
    assert res["share_of_reach"] == res["acceptance_length"] / res["reach_al"] < 1 < res["reach_al"]
    assert "acceptance_length" in res["greedy"]
    assert sum(res["by_position"]["counts"]["drafts"]) == res["counts"]["drafts"]  # sums over the draws
    assert res["drafts"] == round(res["counts"]["drafts"] / res["repeats"])  # one draw's: vLLM's count
    answers = [r["answers"] for r in res["by_position"]["rows"]]  # the samples, not the draws
    assert answers == [sum(d > 0 for d in c) for c in zip(*(offline_eval(
        draft, head, store, [sid], K)["by_position"]["counts"]["drafts"] for sid in store.ids))]
    assert 0 < max(answers) <= len(store.ids)
    assert offline_eval(draft, head, store, store.ids, K, temperature=0.7, seed=3) == res  # seeded
    assert offline_eval(draft, head, store, store.ids, K)["walk"] == "greedy"


# ----------------------------------------------------------------------------- the reach
# An oracle draft proposes the target's greedy token at every depth; walked over the same draws as
# the draft, its AL is the most any draft gets at that temperature (the target's entropy caps it).

FLAT_FROM = 150  # the target's distribution is peaked for the tokens before this position, flat from it on
PEAKED, FLAT = [0.0, -8.0, -8.0, -8.0], [0.0, -0.3, -0.6, -0.9]  # logits of the target's top 4


def topk_sample(sid: str, n: int, seed: int):
    """Greedy data kept as the target's top 4 (row i: its distribution for token i + 1, whose top-1 is
    the data's token, the others tokens the data never holds), peaked before FLAT_FROM, flat from it."""
    from eagle3_train.common.hidden_store import SampleStates

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 50, (n,), generator=g)
    top = torch.stack([torch.cat([ids[1:], ids[:1]])] + [torch.full((n,), 50 + c) for c in range(3)], 1)
    flat = (torch.arange(n) + 1 >= FLAT_FROM)[:, None]
    logits = torch.where(flat, torch.tensor(FLAT), torch.tensor(PEAKED)).log_softmax(-1)
    mask = torch.ones(n, dtype=torch.bool)
    mask[:4] = False  # a 4-token prompt
    return SampleStates(sid, ids, mask, torch.zeros(n, 1, 4), None, top, logits)


def data_draft(model, samples, k, aux_index=None):
    """offline.draft_step_tokens' stand-in proposing the data's tokens (the target's greedy ones here):
    step j at frame position t -> token t + 2 + j; none (-1) past the end."""
    return [[torch.cat([s.input_ids[2 + j:], torch.full((j + 1,), -1)]) for j in range(k)] for s in samples]


def no_draft(model, samples, k, aux_index=None):
    """A draft always wrong: no proposal anywhere (p = 0)."""
    return [[torch.full((len(s.input_ids) - 1,), -1) for _ in range(k)] for s in samples]


def reach_eval(monkeypatch, draft, temperature=1.0):
    from eagle3_train.evaluate import offline

    monkeypatch.setattr(offline, "draft_step_tokens", draft)
    store = SampleStore([topk_sample(f"s{i}", 300, i) for i in range(3)])
    return offline.offline_eval(object(), None, store, store.ids, K, temperature=temperature, seed=5,
                                edges=(0, FLAT_FROM))


def closed_form(logits: list[float]) -> float:
    """AL of a draft whose K steps are each accepted with the target's top-1 probability."""
    p = float(torch.tensor(logits).softmax(-1)[0])
    return 1 + sum(p ** (j + 1) for j in range(K))


def test_a_draft_equal_to_the_oracle_has_the_reach_and_a_wrong_one_one_over_it(monkeypatch):
    """The oracle walks over the same uniforms as the draft: the same proposals give the same counts
    exactly (share 1.0 overall and in every bucket); a draft that never proposes gets AL 1, 1 / reach."""
    res = reach_eval(monkeypatch, data_draft)
    assert res["walk"] == "sampled" and res["reach_al"] == res["acceptance_length"] and res["share_of_reach"] == 1.0
    bp = res["by_position"]
    assert bp["reach_counts"] == bp["counts"] and all(r["drafts"] for r in bp["rows"])
    assert [(r["reach_al"], r["share_of_reach"]) for r in bp["rows"]] == [(r["acceptance_length"], 1.0)
                                                                        for r in bp["rows"]]
    wrong = reach_eval(monkeypatch, no_draft)
    assert wrong["acceptance_length"] == 1.0 and wrong["share_of_reach"] == pytest.approx(1 / wrong["reach_al"])
    assert wrong["reach_al"] == pytest.approx(res["reach_al"], abs=0.03)  # the target's, whatever the draft
    for r in wrong["by_position"]["rows"]:
        assert r["acceptance_length"] == 1.0 and r["share_of_reach"] == pytest.approx(1 / r["reach_al"])


def test_the_reach_falls_where_the_targets_entropy_rises_and_a_perfect_drafts_share_stays_one(monkeypatch):
    """Bucket 0: the target's distribution peaked, bucket 1: flat. The perfect draft is always right
    (greedy AL near 1 + K in both), yet its sampled AL falls with the reach; its share stays 1."""
    res = reach_eval(monkeypatch, data_draft)
    peaked, flat = res["by_position"]["rows"]
    assert peaked["reach_al"] == pytest.approx(closed_form(PEAKED), abs=0.05)
    # below the closed form by the drafts cut short at each sequence's end (counted rejected)
    assert closed_form(FLAT) - 0.05 < flat["reach_al"] < closed_form(FLAT) + 0.01
    assert flat["reach_al"] < 1.6 < 3.9 < peaked["reach_al"]
    assert peaked["share_of_reach"] == flat["share_of_reach"] == 1.0
    greedy = res["greedy"]["by_position"]["rows"]
    assert min(r["acceptance_length"] for r in greedy) > 3.9  # the draft did not get worse: the text got harder


def test_greedy_reports_have_no_reach_and_sampled_ones_show_it(monkeypatch):
    """At temperature 0 nothing of the reach is computed or written (the table as before); at a
    temperature above 0 the table has reach and share, the report the overall figures."""
    from eagle3_train.common import positions
    from eagle3_train.evaluate import offline
    from eagle3_train.evaluate.report import build_report, render_markdown

    def refuse(*a, **kw):
        raise AssertionError("the target's probabilities computed for a greedy evaluation")

    monkeypatch.setattr(offline, "accept_probs", refuse)
    greedy = reach_eval(monkeypatch, data_draft, temperature=0.0)
    assert "reach" not in json.dumps(greedy)
    head = "| position | drafts | answers | AL | p1 | p2 | p3 | note |"
    assert positions.table(greedy["by_position"]["rows"], K).splitlines()[0] == head
    run = {"k": K, "draft": {"path": "d"}, "target": {"name_or_path": "t"},
           "online": {"concurrency": [], "sampling": {}}}
    md = render_markdown(build_report(run, greedy, {}))
    assert head in md and "reach" not in md
    monkeypatch.undo()
    sampled = reach_eval(monkeypatch, data_draft)
    md = render_markdown(build_report(run, sampled, {}))
    assert "| position | drafts | answers | AL | reach | share | p1 | p2 | p3 | note |" in md, md
    peaked = sampled["by_position"]["rows"][0]
    row = (f"| 0-150 | {peaked['drafts']} | {peaked['answers']} | {peaked['acceptance_length']:.3f} | "
           f"{peaked['reach_al']:.3f} | 1.000 |")
    assert row in md
    assert f"would reach AL {sampled['reach_al']:.3f} (reach_al)" in md


# ----------------------------------------------------------------------------- bad inputs


@pytest.mark.parametrize("value", ["-1", "nan"])
def test_04_refuses_a_bad_val_temperature(tmp_path, capfd, value):
    out = tmp_path / "run"
    res = run_inprocess("04_train", ["--hidden-states", tmp_path / "none", "--vocab-mapping", tmp_path / "none",
                                     "--target", tmp_path / "none", "--output-dir", out, "--val-temperature", value],
                        capfd)
    assert_one_error_line(res, "--val-temperature", value)
    assert not out.exists()


def test_05_refuses_a_sampled_walk_on_a_store_without_the_targets_distribution(tmp_path, capfd, store_dir,
                                                                             llama_target_dir):
    store = shutil.copytree(store_dir, tmp_path / "store")
    man = json.loads((store / "manifest.json").read_text())
    man["storage"] = {**(man.get("storage") or {}), "last": "topk"}  # no last state, and no top-k either
    man["storage"].pop("topk", None)
    (store / "manifest.json").write_text(json.dumps(man))
    draft = make_random_draft(tmp_path / "draft", llama_target_dir, k=K)
    out = tmp_path / "eval"
    res = run_inprocess("05_evaluate", ["--draft", draft, "--store", store, "--output-dir", out,
                                        "--temperature", "1.0"], capfd)
    assert_one_error_line(res, "--temperature", "neither the last hidden state nor top-k")
    assert not (out / "manifest.json").exists() and not (out / "offline.json").exists()


def test_05_records_the_sampled_walk_and_refuses_a_rerun_at_another_temperature(tmp_path, store_dir,
                                                                               llama_target_dir):
    from eagle3_train.common.errors import PipelineError
    from helpers import stage_cli

    draft = make_random_draft(tmp_path / "draft", llama_target_dir, k=K)
    out = tmp_path / "eval"
    argv = ["--draft", str(draft), "--store", str(store_dir), "--output-dir", str(out), "--target",
            str(llama_target_dir), "--temperature", "1.0", "--sampled-repeats", "8"]
    assert stage_cli("05_evaluate").main(argv) == 0
    off = json.loads((out / "offline.json").read_text())
    assert (off["walk"], off["temperature"], off["top_p"]) == ("sampled", 1.0, 1.0) and off["walk_se"] < 0.01
    assert off["repeats"] >= 8 and "acceptance_length" in off["greedy"]
    assert json.loads((out / "report.json").read_text())["offline"]["walk"] == "sampled"
    assert off["reach_al"] > 1 and all("reach_al" in r for r in off["by_position"]["rows"])
    # a sampled walk recorded without the reach is recounted on a rerun, not reported without it
    (out / "offline.json").write_text(json.dumps({k: v for k, v in off.items() if k != "reach_al"}))
    assert stage_cli("05_evaluate").main(argv) == 0
    assert json.loads((out / "offline.json").read_text()) == off
    assert "reach_al" in json.loads((out / "report.json").read_text())["offline"]
    with pytest.raises(PipelineError):
        stage_cli("05_evaluate").main(argv[:-4])  # the greedy walk on the same directory: other settings
