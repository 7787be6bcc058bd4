"""The tiny stand-ins: deterministic builders, Kimi's special-token strings, MLA+MoE, a trained target
that closes its reasoning and stops."""

from __future__ import annotations

import json

import pytest
import torch
from eagle3_testkit.tiny import KIMI_SPECIAL_TOKENS, build_tokenizer, synthetic_examples
from eagle3_testkit.tiny_target import check_tiny_target, train_tiny_target


def test_tokenizer_is_deterministic_and_has_kimis_special_tokens(tmp_path, k25_tokenizer_dir):
    build_tokenizer(tmp_path / "again")
    assert (tmp_path / "again" / "tokenizer.json").read_bytes() == (k25_tokenizer_dir / "tokenizer.json").read_bytes()
    tok = json.loads((k25_tokenizer_dir / "tokenizer.json").read_text())
    added = {t["content"] for t in tok["added_tokens"] if t["special"]}
    assert set(KIMI_SPECIAL_TOKENS) <= added


def test_templates_render_like_k25_and_k2_thinking(k25_tokenizer, thinking_first_tokenizer):
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b", "reasoning": "hidden"}, {"role": "user", "content": "c"}]
    k25 = k25_tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert k25 == ("<|im_system|>system<|im_middle|>S<|im_end|><|im_user|>user<|im_middle|>a<|im_end|>"
                   "<|im_assistant|>assistant<|im_middle|><think></think>b<|im_end|>"
                   "<|im_user|>user<|im_middle|>c<|im_end|><|im_assistant|>assistant<|im_middle|><think>")
    first = thinking_first_tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert first == k25[: -len("<think>")]


def test_deepseek_v3_target_is_mla_and_moe(deepseek_target_dir):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(deepseek_target_dir)
    assert cfg.model_type == "deepseek_v3" and cfg.kv_lora_rank and cfg.q_lora_rank and cfg.n_routed_experts > 1
    model = AutoModelForCausalLM.from_pretrained(deepseek_target_dir)
    moe_layers = [m for n, m in model.named_modules() if n.endswith("mlp") and hasattr(m, "experts")]
    assert len(moe_layers) == cfg.num_hidden_layers - cfg.first_k_dense_replace
    out = model(torch.tensor([[3, 4, 5, 6]]))
    assert out.logits.shape == (1, 4, cfg.vocab_size) and torch.isfinite(out.logits).all()


@pytest.mark.parametrize("arch", ["llama", "deepseek_v3"])
def test_training_the_tiny_target_is_reproducible(tmp_path, k25_tokenizer_dir, arch):
    torch.set_num_threads(1)
    a = train_tiny_target(tmp_path / "a", steps=4, batch=4, tokenizer_dir=k25_tokenizer_dir, n_examples=64,
                          check_n=0, log=lambda *_: None, arch=arch)
    b = train_tiny_target(tmp_path / "b", steps=4, batch=4, tokenizer_dir=k25_tokenizer_dir, n_examples=64,
                          check_n=0, log=lambda *_: None, arch=arch)
    assert a["final_loss"] == b["final_loss"] and a["arch"] == arch
    assert json.loads((tmp_path / "a" / "config.json").read_text())["model_type"] == arch
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()


def test_bundled_trained_target_reasons_closes_and_stops(tiny_reasoner_dir):
    stats = check_tiny_target(tiny_reasoner_dir, n=8, seed=123)
    assert stats["closes_reasoning"] >= 0.9 and stats["stops"] >= 0.9
    recorded = json.loads((tiny_reasoner_dir / "training_stats.json").read_text())
    assert recorded["closes_reasoning"] >= 0.9


def test_synthetic_examples_are_deterministic():
    assert synthetic_examples(5, seed=3) == synthetic_examples(5, seed=3)
    assert synthetic_examples(5, seed=3) != synthetic_examples(5, seed=4)
