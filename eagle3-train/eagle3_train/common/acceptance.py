"""Acceptance accounting shared by 04 (validation) and 05 (offline evaluation).

vLLM drafts K tokens at a position, the target verifies them, and the accepted run is the longest
prefix of draft tokens equal to the target's own tokens. Its reported mean acceptance length is
  AL = 1 + accepted / drafts
(the 1 is the bonus token the target adds after every verification).

Where vLLM drafts (`vllm_walk`): not at every position. The target's prefill makes the first
generated token; the first draft follows it; after a draft with `a` accepted tokens the target adds
its bonus token, so the next draft is `a + 1` positions on. Hard stretches therefore get more
drafts than easy ones, and the walked AL is below the average over every position whenever
acceptance comes in bursts. The walked figure is the reported one (`acceptance_length`); the
every-position figure is kept as `al_all_positions`.

Edges, decided here and checked against real vLLM (tests/test_train_vllm.py):
- Sample end: vLLM drafts K tokens even with fewer left; a request ends when the target emits
  its end token (or max_tokens), so no draft starts at the sample's last token. Draft tokens past
  the end cannot be checked offline and count as rejected (vLLM compares them with what the
  target would say after its end token; that difference is at most one partial draft a sample).
- Loss-mask holes (multi-turn): every supervised run is its own request in vLLM; the walk starts
  afresh at each run's first generated token.
"""

from __future__ import annotations

import torch

# Count keys of `chain_acceptance` (ints, or lists of K ints), in the order `flatten` uses.
SCALARS = ("drafts", "accepted", "drafts_all", "accepted_all")
LISTS = ("tried", "hits", "hits_all", "drafts_by_depth", "accepted_by_depth")


def vllm_walk(accepted: torch.Tensor, drafting: torch.Tensor) -> torch.Tensor:
    """Positions [T] where vLLM drafts. `drafting[t]`: a draft at t has a checkable first token
    (the next token is supervised); `accepted[t]`: how many tokens that draft gets accepted. In
    each maximal run of drafting positions the run's first position would propose the first
    generated token, which the target's prefill makes itself, so the walk starts one later and
    jumps by accepted + 1 while it stays inside the run.

    Vectorised, without a host sync: t's next draft is nxt[t] (a sink once past its run), and the
    drafted set is the orbit of the starts, found by pointer doubling in log2(T) rounds."""
    n = drafting.shape[0]
    d = drafting.bool()
    if n == 0:
        return d.clone()
    pos = torch.arange(n, device=d.device)
    no = d.new_zeros(1)
    begin = d & ~torch.cat([no, d[:-1]])
    run = (torch.cumsum(begin.long(), 0) - 1).clamp_min(0)
    last = torch.full((n,), -1, dtype=torch.long, device=d.device).scatter_reduce(
        0, run, torch.where(d, pos, -1), reduce="amax")[run]  # last drafting position of t's run
    sink = torch.full_like(pos, n)
    nxt = pos + accepted.long() + 1
    jump = torch.cat([torch.where(d & (nxt <= last), nxt, sink), sink[:1]])  # the sink maps to itself
    mark = torch.cat([torch.cat([no, begin[:-1]]) & d, no]).long()  # the first draft of each run
    for _ in range(max(n - 1, 1).bit_length()):  # mark: every node within 2**i - 1 steps of a start
        mark = mark.scatter_reduce(0, jump, mark, reduce="amax")
        jump = jump[jump]
    return mark[:n].bool()


def _counts(prefix: torch.Tensor, valid: torch.Tensor, drafting: torch.Tensor) -> tuple[int, int, list, list]:
    """(drafts, accepted, tried[K], hits[K]) over the drafts at `drafting`."""
    k_steps = prefix.shape[0]
    before = torch.cat([torch.ones_like(prefix[:1]), prefix[:-1]], dim=0)  # all earlier steps correct
    tried = [int((before[k].bool() & valid[k] & drafting).sum()) for k in range(k_steps)]
    hits = [int((prefix[k].bool() & drafting).sum()) for k in range(k_steps)]
    return int(drafting.sum()), int((prefix * drafting).sum()), tried, hits


def chain_acceptance(correct: torch.Tensor, valid: torch.Tensor) -> dict:
    """`correct[k, t]`: draft step k at drafting position t equals the target's token t+1+k.
    `valid[k, t]`: that comparison exists (position supervised, t+1+k inside the sequence).

    A draft's accepted length is its number of leading valid-and-correct steps. Counted at the
    positions of vLLM's walk (`vllm_walk`): drafts, accepted, and per step `tried` (drafts whose
    earlier steps were all accepted and whose step k is checkable) and `hits` (drafts with steps
    0..k accepted: vLLM's num_accepted_tokens_per_pos); `drafts_by_depth` / `accepted_by_depth`:
    the same walk had only 1..K tokens been drafted. `*_all`: a draft at every position whose step
    0 is valid (not how vLLM counts). All sums, so batches aggregate with `merge`."""
    if correct.shape != valid.shape or correct.dim() != 2:
        raise ValueError(f"correct {tuple(correct.shape)} and valid {tuple(valid.shape)} must be [K, T]")
    ok = (correct & valid).to(torch.int64)
    prefix = torch.cumprod(ok, dim=0)  # prefix[k, t] = steps 0..k all correct
    accepted = prefix.sum(dim=0)
    every = valid[0]
    drafts, acc, tried, hits = _counts(prefix, valid, vllm_walk(accepted, every))
    drafts_all, acc_all, _, hits_all = _counts(prefix, valid, every)
    by_depth = [(drafts, acc)]  # depth K
    for depth in range(prefix.shape[0] - 1, 0, -1):
        walked = vllm_walk(accepted.clamp_max(depth), every)
        by_depth.append((int(walked.sum()), int((accepted.clamp_max(depth) * walked).sum())))
    by_depth.reverse()
    return {"drafts": drafts, "accepted": acc, "tried": tried, "hits": hits,
            "drafts_all": drafts_all, "accepted_all": acc_all, "hits_all": hits_all,
            "drafts_by_depth": [x[0] for x in by_depth], "accepted_by_depth": [x[1] for x in by_depth]}


def empty(k_steps: int) -> dict:
    return {**{key: 0 for key in SCALARS}, **{key: [0] * k_steps for key in LISTS}}


def merge(stats: list[dict]) -> dict:
    """Sums of `chain_acceptance` counts (a count a record lacks, e.g. from an older checkpoint,
    adds nothing)."""
    k_steps = max((len(s.get("tried") or []) for s in stats), default=0)
    out = empty(k_steps)
    for s in stats:
        for key in SCALARS:
            out[key] += s.get(key) or 0
        for key in LISTS:
            out[key] = [a + b for a, b in zip(out[key], s.get(key) or [0] * k_steps)]
    return out


def flatten(stats: dict) -> list[int]:
    """The counts as one flat list (for an all-reduce); `unflatten` inverts it."""
    return [stats[key] for key in SCALARS] + [x for key in LISTS for x in stats[key]]


def unflatten(values: list, k_steps: int) -> dict:
    vals = [int(round(v)) for v in values]
    out = dict(zip(SCALARS, vals[:len(SCALARS)]))
    rest = vals[len(SCALARS):]
    for i, key in enumerate(LISTS):
        out[key] = rest[i * k_steps:(i + 1) * k_steps]
    return out


def summarize(stats: dict) -> dict:
    """Counts -> rates over vLLM's walk: conditional[k] = P(step k accepted | steps < k accepted),
    cumulative[k] = P(steps 0..k all accepted) (vLLM's per-position rate), the acceptance length
    and, per depth d, the acceptance length had d tokens been drafted; and the every-position
    figures (`al_all_positions`, `cumulative_all_positions`)."""
    drafts = max(stats["drafts"], 1)
    tried, hits = stats["tried"] or [], stats["hits"] or []
    drafts_all = max(stats.get("drafts_all") or 0, 1)
    return {
        "drafts": stats["drafts"],
        "acceptance_length": 1.0 + stats["accepted"] / drafts,
        "conditional": [h / t if t else 0.0 for h, t in zip(hits, tried)],
        "cumulative": [h / drafts for h in hits],
        "al_by_depth": [1.0 + a / d if d else 1.0 for d, a in zip(stats.get("drafts_by_depth") or [],
                                                                   stats.get("accepted_by_depth") or [])],
        "drafts_all_positions": stats.get("drafts_all"),
        "al_all_positions": 1.0 + (stats.get("accepted_all") or 0) / drafts_all,
        "cumulative_all_positions": [h / drafts_all for h in stats.get("hits_all") or []],
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
