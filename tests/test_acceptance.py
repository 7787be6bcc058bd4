"""Acceptance accounting: chain acceptance and vLLM's AL = 1 + accepted / drafts."""

import torch

from eagle3_train.acceptance import chain_acceptance, draft_correctness, merge, summarize


def test_chain_stops_at_first_miss():
    # 3 drafting positions, K = 3: accepted runs 3, 1 (miss at step 1, later hit ignored), 0.
    correct = torch.tensor([[1, 1, 0], [1, 0, 1], [1, 1, 1]], dtype=torch.bool)
    valid = torch.ones(3, 3, dtype=torch.bool)
    s = chain_acceptance(correct, valid)
    assert s["drafts"] == 3 and s["accepted"] == 3 + 1 + 0
    r = summarize(s)
    assert r["acceptance_length"] == 1 + 4 / 3
    assert r["cumulative"] == [2 / 3, 1 / 3, 1 / 3]
    assert r["conditional"] == [2 / 3, 1 / 2, 1.0]


def test_invalid_steps_end_the_chain_and_positions_without_a_first_step_are_not_drafts():
    correct = torch.ones(2, 3, dtype=torch.bool)
    valid = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    s = chain_acceptance(correct, valid)
    assert s["drafts"] == 2 and s["accepted"] == 2 + 1


def test_merge_equals_one_pass():
    g = torch.Generator().manual_seed(0)
    c = torch.rand(4, 50, generator=g) > 0.3
    v = torch.rand(4, 50, generator=g) > 0.1
    whole = chain_acceptance(c, v)
    parts = merge([chain_acceptance(c[:, :20], v[:, :20]), chain_acceptance(c[:, 20:], v[:, 20:])])
    assert parts == whole


def test_draft_correctness_aligns_step_k_with_token_t_plus_1_plus_k():
    ids = torch.tensor([5, 6, 7, 8, 9])
    mask = torch.tensor([0, 1, 1, 1, 1])
    perfect = [ids[1:].tolist() + [0], ids[2:].tolist() + [0, 0]]
    correct, valid = draft_correctness([torch.tensor(p) for p in perfect], ids, mask)
    assert valid.tolist() == [[True] * 4 + [False], [True] * 3 + [False] * 2]
    assert (correct | ~valid).all()
    assert summarize(chain_acceptance(correct, valid))["acceptance_length"] == 1 + (2 + 2 + 2 + 1) / 4
