"""Acceptance accounting: chain acceptance, vLLM's walk, and AL = 1 + accepted / drafts."""

import random

import torch
from eagle3_train.common.acceptance import (
    chain_acceptance,
    draft_correctness,
    flatten,
    merge,
    summarize,
    unflatten,
    vllm_walk,
)


def frame(mask: list[int], k: int, right) -> tuple[torch.Tensor, torch.Tensor]:
    """(correct, valid) for one sample with `mask`, where the draft's token for position p is
    right iff right(p) (step j at t predicts position t+1+j), through draft_correctness."""
    ids = torch.arange(len(mask))
    drafts = [torch.tensor([p if right(p) else -1 for p in range(1 + j, len(mask) + 1 + j)]) for j in range(k)]
    return draft_correctness(drafts, ids, torch.tensor(mask))


def test_walk_drafts_after_the_prefill_token_and_jumps_by_accepted_plus_one():
    # Prompt 0-1, generated 2..9 (9 = end token), K = 3, the draft always right. vLLM: prefill makes
    # token 2; draft at 2 -> 3,4,5 accepted, bonus 6; draft at 6 -> 7,8,9 accepted; 9 ends it.
    s = chain_acceptance(*frame([0, 0] + [1] * 8, 3, lambda p: True))
    assert (s["drafts"], s["accepted"]) == (2, 6)
    assert s["hits"] == [2, 2, 2]
    # Every position 1..8 drafting instead: accepted min(3, 9 - t).
    assert (s["drafts_all"], s["accepted_all"]) == (8, 3 * 6 + 2 + 1)
    r = summarize(s)
    assert r["acceptance_length"] == 4.0 and r["al_all_positions"] == 1 + 21 / 8
    assert r["cumulative"] == [1.0, 1.0, 1.0]


def test_walk_near_the_end_counts_a_full_draft_with_the_steps_past_the_end_rejected():
    # Generated 2..6: draft at 2 -> 3,4,5 accepted, bonus 6 = the end: no draft at 6. Then with
    # generated 2..7: draft at 6 proposes 7 and two tokens past the end: one accepted.
    s = chain_acceptance(*frame([0, 0] + [1] * 5, 3, lambda p: True))
    assert (s["drafts"], s["accepted"]) == (1, 3)
    s = chain_acceptance(*frame([0, 0] + [1] * 6, 3, lambda p: True))
    assert (s["drafts"], s["accepted"], s["hits"], s["tried"]) == (2, 4, [2, 1, 1], [2, 1, 1])
    assert summarize(s)["cumulative"] == [1.0, 0.5, 0.5]


def test_bursty_acceptance_walked_is_below_all_positions():
    # Generated 2..22, K = 2; tokens up to 12 easy (draft right), after that hard (draft wrong).
    # Walk: 2, 5, 8 (2 accepted each), 11 (1: token 12 yes, 13 no), then 13..21 one by one (0).
    s = chain_acceptance(*frame([0, 0] + [1] * 21, 2, lambda p: p <= 12))
    assert (s["drafts"], s["accepted"]) == (4 + 9, 2 + 2 + 2 + 1)
    # Every position 1..21: 2 each at 1..10, 1 at 11, 0 at 12..21.
    assert (s["drafts_all"], s["accepted_all"]) == (21, 21)
    r = summarize(s)
    assert r["acceptance_length"] == 1 + 7 / 13 < r["al_all_positions"] == 2.0
    assert s["hits"] == [4, 3] and s["tried"] == [13, 4]
    # Drafting 1 token instead: 2, 4, 6, 8, 10 accepted 1 each (next 12), then 12..21 rejected.
    assert (s["drafts_by_depth"], s["accepted_by_depth"]) == ([5 + 10, 13], [5, 7])


def test_loss_mask_holes_start_a_new_request():
    # Turn 1 generated 1..3, turn 2 generated 6..8: each prefill makes its first token.
    s = chain_acceptance(*frame([0, 1, 1, 1, 0, 0, 1, 1, 1], 3, lambda p: True))
    assert (s["drafts"], s["accepted"]) == (2, 4)  # at 1 (2, 3) and at 6 (7, 8)
    # A one-token hole: turn 2 = 4..5 is its own request (draft at 4 only), not the walk from turn 1
    # jumping into it.
    s = chain_acceptance(*frame([0, 1, 1, 0, 1, 1], 3, lambda p: True))
    assert (s["drafts"], s["accepted"]) == (2, 2)


def test_misses_end_the_chain():
    # Generated 1..9, K = 3; the draft is wrong on tokens 3 and 7 only.
    # Walk: at 1, token 2 yes, 3 no: 1 accepted, bonus 3; at 3: 4, 5, 6 accepted, bonus 7; at 7:
    # 8, 9 accepted (the third step is past the end); 9 ends it.
    s = chain_acceptance(*frame([0] + [1] * 9, 3, lambda p: p not in (3, 7)))
    assert (s["drafts"], s["accepted"]) == (3, 1 + 3 + 2)
    assert s["hits"] == [3, 2, 1] and s["tried"] == [3, 3, 1]  # at 7 step 2 is not checkable


def test_walk_matches_a_plain_loop_on_random_sequences():
    def loop(acc, d):
        out, t = [False] * len(d), 0
        while t < len(d):
            if not d[t]:
                t += 1
                continue
            r0 = t
            while t < len(d) and d[t]:
                t += 1
            u = r0 + 1
            while u < t:
                out[u] = True
                u += acc[u] + 1
        return out

    rng = random.Random(0)
    for _ in range(500):
        n = rng.randint(0, 80)
        d = [rng.random() < 0.85 for _ in range(n)]
        acc = [rng.randint(0, 5) for _ in range(n)]
        assert vllm_walk(torch.tensor(acc, dtype=torch.long), torch.tensor(d, dtype=torch.bool)).tolist() == loop(acc, d)


def test_bursts_on_a_long_sequence_overstate_all_positions():
    # Easy and hard stretches (a two-state chain), K = 3: the every-position average is too high.
    g = torch.Generator().manual_seed(0)
    n, easy, flips = 20000, [], torch.rand(20000, generator=g) < 0.02
    state = True
    for f in flips.tolist():
        state = state != f
        easy.append(state)
    p_right = torch.where(torch.tensor(easy), 0.9, 0.2)
    right = (torch.rand(n + 4, generator=g) < torch.cat([p_right, p_right[-4:]])).tolist()
    r = summarize(chain_acceptance(*frame([0] + [1] * (n - 1), 3, lambda p: right[p])))
    assert r["al_all_positions"] - r["acceptance_length"] > 0.2, r


def test_merge_equals_one_pass_and_flatten_round_trips():
    g = torch.Generator().manual_seed(0)
    c = torch.rand(4, 50, generator=g) > 0.3
    v = torch.rand(4, 50, generator=g) > 0.1
    v[:, 19] = False  # the split point lies between two runs, as between two samples
    whole = chain_acceptance(c, v)
    parts = merge([chain_acceptance(c[:, :20], v[:, :20]), chain_acceptance(c[:, 20:], v[:, 20:])])
    assert parts == whole
    assert unflatten([float(x) for x in flatten(whole)], 4) == whole
    assert merge([{"drafts": 1, "accepted": 2, "tried": [1], "hits": [1]}])["drafts_all"] == 0  # older records


def test_draft_correctness_aligns_step_k_with_token_t_plus_1_plus_k():
    ids = torch.tensor([5, 6, 7, 8, 9])
    mask = torch.tensor([0, 1, 1, 1, 1])
    perfect = [ids[1:].tolist() + [0], ids[2:].tolist() + [0, 0]]
    correct, valid = draft_correctness([torch.tensor(p) for p in perfect], ids, mask)
    assert valid.tolist() == [[True] * 4 + [False], [True] * 3 + [False] * 2]
    assert (correct | ~valid).all()
    s = chain_acceptance(correct, valid)
    assert summarize(s)["al_all_positions"] == 1 + (2 + 2 + 2 + 1) / 4
    assert (s["drafts"], s["accepted"]) == (1, 2)  # at 1: tokens 2, 3, bonus 4 = the end
