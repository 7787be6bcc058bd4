"""Builders for 05's tests: a speculators-format EAGLE-3 draft (random weights) and a small
hidden-state store of greedy continuations, made directly with the target in transformers."""

from __future__ import annotations

import json
from pathlib import Path


def make_random_draft(out_dir: Path, target_dir: Path, *, k: int = 3, aux_ids=None,
                      draft_vocab: int | None = None, seed: int = 0) -> Path:
    """A one-layer Llama-style EAGLE-3 draft for `target_dir`, randomly initialised, saved with
    speculators' save_pretrained (what vLLM loads). Draft vocab = the lowest `draft_vocab` ids."""
    import torch
    from speculators import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import AutoConfig, LlamaConfig

    tc = AutoConfig.from_pretrained(target_dir)
    n = tc.num_hidden_layers
    vocab = tc.vocab_size
    draft_vocab = draft_vocab or vocab // 2
    layer = LlamaConfig(vocab_size=vocab, hidden_size=tc.hidden_size, intermediate_size=tc.intermediate_size,
                        num_attention_heads=tc.num_attention_heads, num_key_value_heads=tc.num_key_value_heads,
                        head_dim=tc.hidden_size // tc.num_attention_heads, rms_norm_eps=tc.rms_norm_eps,
                        max_position_embeddings=tc.max_position_embeddings, num_hidden_layers=1)
    layer._attn_implementation = "sdpa"
    cfg = Eagle3SpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=draft_vocab, norm_before_residual=True,
        target_hidden_size=tc.hidden_size,
        eagle_aux_hidden_state_layer_ids=list(aux_ids or (2, n // 2, n - 3)),
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", default_proposal_method="greedy",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=k)],
            verifier=VerifierConfig.from_pretrained(str(target_dir))))
    torch.manual_seed(seed)
    model = Eagle3DraftModel(cfg)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[:draft_vocab] = True
    model.load_vocab_mappings(t2d, torch.zeros(draft_vocab, dtype=torch.long))
    model.load_verifier_weights()
    # Random weights, but not NaN: lm_head is loaded from the target (restricted to the draft vocab).
    model.save_pretrained(str(out_dir))
    return Path(out_dir)


def make_greedy_store(out_dir: Path, target_dir: Path, *, n: int = 6, seed: int = 11, max_new: int = 40,
                      aux_ids=None, id_prefix: str = "g") -> Path:
    """A complete 02-format store of `n` synthetic prompts + the target's greedy continuation
    (loss mask on the continuation): aux = residual stream entering each aux layer, last = the
    last layer's output before the final norm (helpers_train.target_features)."""
    import torch
    from eagle3_testkit.tiny import synthetic_examples
    from eagle3_train.common.hidden_store import STAGE, describe_storage, write_shard
    from eagle3_train.common.manifest import describe_target, describe_tokenizer, write_manifest
    from helpers_train import target_features
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(target_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    nl = model.config.num_hidden_layers
    aux_ids = list(aux_ids or (2, nl // 2, nl - 3))
    rows = {"input_ids": [], "loss_mask": [], "aux": [], "last": []}
    samples = []
    with torch.no_grad():
        for i, ex in enumerate(synthetic_examples(n, seed)):
            prompt = tok.apply_chat_template([{"role": "user", "content": ex["question"]}],
                                             add_generation_prompt=True, tokenize=True, return_dict=False)
            ids = torch.tensor([list(prompt)])
            full = model.generate(ids, max_new_tokens=max_new, do_sample=False,
                                  attention_mask=torch.ones_like(ids))[0]
            aux, last, _ = target_features(model, full.tolist(), aux_ids)
            rows["input_ids"].append(full.to(torch.int32))
            rows["loss_mask"].append((torch.arange(len(full)) >= ids.shape[1]).to(torch.uint8))
            rows["aux"].append(aux)
            rows["last"].append(last)
            samples.append({"id": f"{id_prefix}{seed}-{i:03d}", "length": len(full)})
    write_shard(out_dir, 0, samples, {k: torch.cat(v) for k, v in rows.items()})
    write_manifest(out_dir, STAGE, config={"n": n, "seed": seed}, layer_ids=[*aux_ids, nl], aux_layer_ids=aux_ids,
                   hidden_size=model.config.hidden_size,
                   storage=describe_storage("fp32", len(aux_ids), model.config.hidden_size),
                   target=describe_target(model.config, str(target_dir)),
                   tokenizer=describe_tokenizer(tok, str(target_dir)),
                   counts={"samples": n, "tokens": sum(s["length"] for s in samples)})
    (out_dir / "greedy.json").write_text(json.dumps({"prompt_lens": [int(m.numel() - m.sum())
                                                                     for m in rows["loss_mask"]]}))
    return out_dir
