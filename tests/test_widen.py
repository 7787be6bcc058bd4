"""The width ladder's targets (widen.py): the same function at a wider residual stream."""

from __future__ import annotations

import json

import pytest
import torch
from eagle3_testkit.fixtures import tiny_reasoner_dir
from eagle3_testkit.widen import lift_matrix, widen_target
from eagle3_train.common.errors import PipelineError


@pytest.fixture(scope="module")
def narrow():
    return tiny_reasoner_dir()  # a trained 64-wide Llama: structured states, not random ones


@pytest.mark.parametrize("width", [64, 160, 256])
def test_a_widened_target_computes_the_same_logits_and_rotated_states(narrow, tmp_path, width):
    from transformers import AutoModelForCausalLM

    wide_dir = widen_target(narrow, tmp_path / "wide", width, seed=3)
    cfg = json.loads((wide_dir / "config.json").read_text())
    assert cfg["hidden_size"] == width and cfg["widened_from"]["hidden_size"] == 64
    a = AutoModelForCausalLM.from_pretrained(narrow, dtype=torch.float32).eval()
    b = AutoModelForCausalLM.from_pretrained(wide_dir, dtype=torch.float32).eval()
    ids = torch.randint(3, a.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        oa, ob = a(ids, output_hidden_states=True), b(ids, output_hidden_states=True)
    torch.testing.assert_close(ob.logits, oa.logits, atol=2e-4, rtol=1e-4)
    lift = lift_matrix(64, width, seed=3).float()
    for layer in range(1, a.config.num_hidden_layers):  # the residual stream 02 stores (the last is normed)
        ha, hb = oa.hidden_states[layer], ob.hidden_states[layer]
        torch.testing.assert_close(hb, ha @ lift.T, atol=5e-4, rtol=1e-4)
        torch.testing.assert_close(hb.pow(2).mean(), ha.pow(2).mean(), rtol=1e-4, atol=0)  # RMS kept
    assert torch.equal(a.generate(ids[:1, :8], max_new_tokens=12, do_sample=False),
                       b.generate(ids[:1, :8], max_new_tokens=12, do_sample=False))
    # the tokenizer travels with it: stages that check its fingerprint accept the wide target
    assert (wide_dir / "tokenizer.json").read_bytes() == (narrow / "tokenizer.json").read_bytes()


def test_the_lift_is_orthonormal_up_to_scale_and_seeded():
    m = lift_matrix(32, 96, seed=1).double()
    torch.testing.assert_close(m.T @ m, torch.eye(32, dtype=torch.float64) * 3, atol=1e-10, rtol=0)
    assert torch.equal(m, lift_matrix(32, 96, seed=1)) and not torch.equal(m, lift_matrix(32, 96, seed=2))


def test_refusals(narrow, tmp_path):
    from eagle3_testkit.fixtures import random_target_dir

    with pytest.raises(PipelineError, match="below the target's hidden size 64"):
        widen_target(narrow, tmp_path / "w", 32)
    with pytest.raises(PipelineError, match="only a Llama target can be widened"):
        widen_target(random_target_dir("deepseek_v3"), tmp_path / "w", 256)
    assert not (tmp_path / "w").exists()
