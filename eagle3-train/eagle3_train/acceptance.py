"""Acceptance accounting shared by 04 (validation) and 05 (offline evaluation).

vLLM drafts K tokens at a position, the target verifies them, and the accepted run is the longest
prefix of draft tokens equal to the target's own tokens. Its reported mean acceptance length is
  AL = 1 + accepted / drafts
(the 1 is the bonus token the target adds after every verification).
"""

from __future__ import annotations

import torch


def chain_acceptance(correct: torch.Tensor, valid: torch.Tensor) -> dict:
    """`correct[k, t]`: draft step k at drafting position t equals the target's token t+1+k.
    `valid[k, t]`: that comparison exists (position supervised, t+1+k inside the sequence).

    A draft at t is counted when step 0 is valid; its accepted length is the number of leading
    valid-and-correct steps. Returns per-step conditional and cumulative rates, AL, and counts
    (sums, so callers can aggregate over batches with `merge`)."""
    if correct.shape != valid.shape or correct.dim() != 2:
        raise ValueError(f"correct {tuple(correct.shape)} and valid {tuple(valid.shape)} must be [K, T]")
    ok = (correct & valid).to(torch.int64)
    prefix = torch.cumprod(ok, dim=0)  # prefix[k, t] = steps 0..k all correct
    drafting = valid[0]
    accepted = prefix[:, drafting].sum(dim=0)  # [num drafts]
    k_steps = correct.shape[0]
    before = torch.cat([torch.ones_like(prefix[:1]), prefix[:-1]], dim=0)  # all earlier steps correct
    return {
        "drafts": int(drafting.sum()),
        "accepted": int(accepted.sum()),
        # step k tried on positions whose steps < k were all accepted and step k is valid
        "tried": [int((before[k].bool() & valid[k] & drafting).sum()) for k in range(k_steps)],
        "hits": [int((prefix[k].bool() & drafting).sum()) for k in range(k_steps)],
    }


def merge(stats: list[dict]) -> dict:
    out = {"drafts": 0, "accepted": 0, "tried": None, "hits": None}
    for s in stats:
        out["drafts"] += s["drafts"]
        out["accepted"] += s["accepted"]
        for key in ("tried", "hits"):
            out[key] = list(s[key]) if out[key] is None else [a + b for a, b in zip(out[key], s[key])]
    return out


def summarize(stats: dict) -> dict:
    """Counts -> rates: conditional[k] = P(step k accepted | steps < k accepted),
    cumulative[k] = P(steps 0..k all accepted), and vLLM's acceptance length."""
    drafts = max(stats["drafts"], 1)
    tried, hits = stats["tried"] or [], stats["hits"] or []
    return {
        "drafts": stats["drafts"],
        "acceptance_length": 1.0 + stats["accepted"] / drafts,
        "conditional": [h / t if t else 0.0 for h, t in zip(hits, tried)],
        "cumulative": [h / drafts for h in hits],
    }


def draft_correctness(draft_tokens: list[torch.Tensor], input_ids: torch.Tensor,
                      loss_mask: torch.Tensor, target_tokens: torch.Tensor | None = None,
                      document_ids: torch.Tensor | None = None):
    """Build (correct, valid) [K, T] from per-step draft predictions (target-vocab ids, [T] each).

    Draft step k at position t predicts the token at t+1+k. The reference is `target_tokens`
    (the target's own greedy choice at each position, [T], i.e. for token t+1) when given, else
    the sequence itself (right when the data was generated greedily by the target).
    `document_ids` [T] (optional, for several sequences packed into one): a step is valid only
    when t and t+1+k lie in the same document; positions with a negative id draft nothing."""
    seq_len = input_ids.shape[-1]
    ref_next = target_tokens if target_tokens is not None else torch.cat(
        [input_ids[1:], input_ids.new_zeros(1)])
    k_steps = len(draft_tokens)
    correct = torch.zeros(k_steps, seq_len, dtype=torch.bool, device=input_ids.device)
    valid = torch.zeros(k_steps, seq_len, dtype=torch.bool, device=input_ids.device)
    mask = loss_mask.bool()
    for k, pred in enumerate(draft_tokens):
        n = seq_len - 1 - k  # positions t with t+1+k < seq_len
        if n <= 0:
            continue
        # The reference for step k at t is the target's token at t+1+k, i.e. ref_next[t+k].
        correct[k, :n] = pred[:n] == ref_next[k: k + n]
        valid[k, :n] = mask[1 + k: 1 + k + n]
        if document_ids is not None:
            valid[k, :n] &= (document_ids[:n] == document_ids[1 + k: 1 + k + n]) & (document_ids[:n] >= 0)
    return correct, valid
