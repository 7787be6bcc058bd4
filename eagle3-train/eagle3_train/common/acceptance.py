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

from collections.abc import Sequence

import torch

from eagle3_train.common import positions

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


def chain_acceptance(correct: torch.Tensor, valid: torch.Tensor, first_pos: torch.Tensor | None = None,
                     edges: Sequence[int] = positions.EDGES) -> dict:
    """`correct[k, t]`: draft step k at drafting position t equals the target's token t+1+k.
    `valid[k, t]`: that comparison exists (position supervised, t+1+k inside the sequence).

    A draft's accepted length is its number of leading valid-and-correct steps. Counted at the
    positions of vLLM's walk (`vllm_walk`): drafts, accepted, and per step `tried` (drafts whose
    earlier steps were all accepted and whose step k is checkable) and `hits` (drafts with steps
    0..k accepted: vLLM's num_accepted_tokens_per_pos); `drafts_by_depth` / `accepted_by_depth`:
    the same walk had only 1..K tokens been drafted. `*_all`: a draft at every position whose step
    0 is valid (not how vLLM counts). All sums, so batches aggregate with `merge`.
    `first_pos` [T] (optional): the sequence position of the token a draft at t proposes first;
    adds `by_position`, the walked drafts counted by bucket (`walk_positions`)."""
    if correct.shape != valid.shape or correct.dim() != 2:
        raise ValueError(f"correct {tuple(correct.shape)} and valid {tuple(valid.shape)} must be [K, T]")
    ok = (correct & valid).to(torch.int64)
    prefix = torch.cumprod(ok, dim=0)  # prefix[k, t] = steps 0..k all correct
    accepted = prefix.sum(dim=0)
    every = valid[0]
    walk = vllm_walk(accepted, every)
    drafts, acc, tried, hits = _counts(prefix, valid, walk)
    drafts_all, acc_all, _, hits_all = _counts(prefix, valid, every)
    by_depth = [(drafts, acc)]  # depth K
    for depth in range(prefix.shape[0] - 1, 0, -1):
        walked = vllm_walk(accepted.clamp_max(depth), every)
        by_depth.append((int(walked.sum()), int((accepted.clamp_max(depth) * walked).sum())))
    by_depth.reverse()
    out = {"drafts": drafts, "accepted": acc, "tried": tried, "hits": hits,
           "drafts_all": drafts_all, "accepted_all": acc_all, "hits_all": hits_all,
           "drafts_by_depth": [x[0] for x in by_depth], "accepted_by_depth": [x[1] for x in by_depth]}
    if first_pos is not None:
        out["by_position"] = walk_positions(prefix, walk, first_pos, edges)
    return out


def walk_positions(prefix: torch.Tensor, walk: torch.Tensor, first_pos: torch.Tensor,
                   edges: Sequence[int] = positions.EDGES) -> dict:
    """`positions.count` of the drafts at `walk` [T], each at `first_pos[t]` with `prefix[k, t]`
    (steps 0..k accepted; its sum over k is the accepted count); on the device, one sync at the end."""
    k_steps = prefix.shape[0]
    bounds = torch.tensor(list(edges[1:]), dtype=torch.long, device=first_pos.device)
    bucket = torch.bucketize(first_pos[walk].long(), bounds, right=True)  # = positions.bucket_of
    n = len(edges)
    hits = torch.zeros(k_steps, n, dtype=prefix.dtype, device=prefix.device).index_add_(1, bucket, prefix[:, walk])
    drafts = torch.zeros(n, dtype=torch.long, device=prefix.device).index_add_(
        0, bucket, torch.ones_like(bucket))
    return {"edges": list(edges), "k": k_steps, "drafts": drafts.tolist(), "accepted": hits.sum(0).tolist(),
            "hits": hits.T.tolist()}


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
    by_position = [s["by_position"] for s in stats if s.get("by_position")]
    if by_position:
        out["by_position"] = positions.merge(by_position)
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


# ----------------------------------------------------------------------------- sampled serving
# At temperature > 0 vLLM's rejection sampler, given a greedy draft (eagle3's and dflash's default:
# `draft_sample_method: greedy`, so no draft probabilities), accepts a drafted token x with the
# target's probability of x after temperature and top-p (u < p(x)); the walk above counts instead
# whether x is the target's argmax. The functions below give that acceptance walk.


def sampling_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """[n, V] float32: the target's distribution as vLLM's rejection sampler sees it: logits /
    temperature, top-p as vLLM's `apply_top_k_top_p` (sorted ascending, the tokens whose cumulative
    mass from the bottom is at most 1 - top_p dropped, the most likely always kept), softmax."""
    x = logits.float() / temperature
    if top_p < 1.0:
        srt, idx = x.sort(dim=-1)
        drop = srt.softmax(-1).cumsum(-1) <= 1 - top_p
        drop[..., -1] = False
        x = torch.empty_like(x).scatter_(-1, idx, srt.masked_fill(drop, float("-inf")))
    return x.softmax(-1)


def proposal_probs(draft_tokens: list[torch.Tensor], rows, temperature: float, top_p: float = 1.0,
                   chunk: int = 1024, greedy: torch.Tensor | None = None):
    """p [K, T]: the probability that vLLM accepts draft step k's proposal at t, i.e. the target's
    `sampling_probs` of `draft_tokens[k][t]` as token t+1+k, read in row t+k (row j: the target's
    distribution for token j+1, the frame of `draft_correctness`' target_tokens).

    `rows(a, b)` -> (logits [b-a, V] of rows a..b-1, ids): ids None when the logits cover the whole
    vocabulary (the last hidden state through the target's head), else the token id of each column
    [b-a, V'] (a stored top-k: renormalised over it, so its probabilities are slightly high). Rows
    come `chunk` at a time: [T, V] never exists at once. A negative proposal (none) gets 0.
    `greedy` [T] (optional): the target's greedy token of each row; then (p, `oracle_probs` of it)
    from the same rows, the acceptance of a draft that always proposes the target's greedy token."""
    k_steps = len(draft_tokens)
    n = draft_tokens[0].shape[0] if k_steps else 0
    out = torch.zeros(k_steps, n)
    top = torch.zeros(n) if greedy is not None else None

    def pick(here, ids, tok):  # the probability of tok [m] in each row of here [m, V]
        if ids is None:
            p = here.gather(-1, tok.clamp_min(0)[:, None]).squeeze(-1)
        else:
            p = (here * (ids == tok[:, None])).sum(-1)
        return torch.where(tok >= 0, p, 0.0).float().cpu()

    for a in range(0, n, chunk):
        b = min(a + chunk, n)
        logits, ids = rows(a, b)
        probs = sampling_probs(logits, temperature, top_p)
        for k in range(min(k_steps, b)):
            j = torch.arange(max(a, k), b)  # rows j serve step k at t = j - k
            out[k, j - k] = pick(probs[j - a], None if ids is None else ids[j - a],
                                 draft_tokens[k][j - k].to(probs.device).long())
        if top is not None:
            top[a:b] = pick(probs, ids, greedy[a:b].to(probs.device).long())
    return out if top is None else (out, oracle_probs(top, k_steps))


def oracle_probs(top: torch.Tensor, k_steps: int) -> torch.Tensor:
    """p [K, T] of the oracle draft (the target's greedy token at every depth, given the data's
    prefix) from `top` [T], row j's probability of its greedy token: step k at t reads row t + k;
    steps past the last row get 0 (never valid there)."""
    n = top.shape[0]
    out = torch.zeros(k_steps, n)
    for k in range(min(k_steps, n)):
        out[k, :n - k] = top[k:]
    return out


def sampled_frame(p: torch.Tensor, valid: torch.Tensor, repeats: int, generator: torch.Generator,
                  first_pos: torch.Tensor | None = None):
    """`repeats` independent draws of vLLM's verification over one sequence, as one (correct,
    valid) [K, R*(T+1)] for `chain_acceptance`: step k at t is accepted when u < p[k, t] (u uniform,
    vLLM's test without draft probabilities; the chain rule and the walk then stop at the first
    rejection and jump by the sampled accepted count + 1). The draws lie side by side with one
    never-valid column between them, so each is walked on its own. Column c is position c % (T+1)
    of the sequence; `first_pos` [T] (optional) is repeated the same way (third item, else None)."""
    k_steps, n = p.shape
    u = torch.rand(repeats, k_steps, n, generator=generator)
    gap = torch.zeros(repeats, k_steps, 1, dtype=torch.bool)

    def tile(x):  # [R, K, T] -> [K, R*(T+1)], a never-valid column after each draw
        return torch.cat([x, gap], 2).permute(1, 0, 2).reshape(k_steps, repeats * (n + 1))

    correct = tile(u < p[None].float())
    valid_r = tile(valid.bool()[None].expand(repeats, -1, -1))
    pos = None
    if first_pos is not None:
        pos = torch.cat([first_pos[None].expand(repeats, -1), first_pos.new_zeros(repeats, 1)], 1).reshape(-1)
    return correct, valid_r, pos


def sampled_acceptance(p: torch.Tensor, valid: torch.Tensor, repeats: int, generator: torch.Generator,
                       first_pos: torch.Tensor | None = None,
                       edges: Sequence[int] = positions.EDGES) -> tuple[dict, torch.Tensor]:
    """The sampled walk over one sequence: (`chain_acceptance` counts summed over `repeats`
    draws of `sampled_frame`, by position too with `first_pos`; per draw [R, 2] (drafts, accepted),
    for the Monte-Carlo error). `summarize` of the counts gives the expected AL and per-position
    rates vLLM shows when it samples.

    Approximation: after an accepted proposal that differs from the data's token, vLLM's next
    verification conditions on the proposal, while here the target's distribution (and the
    draft's next proposal) come from the data's prefix. Data sampled from the target at the
    served temperature makes the two prefixes alike in distribution; greedy data does not."""
    correct, valid_r, pos = sampled_frame(p, valid, repeats, generator, first_pos)
    counts = chain_acceptance(correct, valid_r, pos, edges)
    accepted = torch.cumprod((correct & valid_r).long(), 0).sum(0)
    walk = vllm_walk(accepted, valid_r[0])
    per_draw = torch.stack([walk.long(), accepted * walk], 0).reshape(2, repeats, -1).sum(-1).T
    return counts, per_draw


def walk_error(per_draw: torch.Tensor) -> float:
    """Standard error of the sampled walk's AL from the per-draw (drafts, accepted) sums [R, 2]
    over the whole evaluation (draw r of every sequence is one replica of it)."""
    drafts, accepted = per_draw[:, 0].double(), per_draw[:, 1].double()
    al = 1 + accepted / drafts.clamp_min(1)
    return float(al.std() / al.numel() ** 0.5) if al.numel() > 1 else float("inf")


def sampled_walk(parts: list, seed: int = 0, repeats: int = 32, target_se: float = 0.01,
                 max_repeats: int = 4096, edges: Sequence[int] = positions.EDGES,
                 reach: Sequence[torch.Tensor] | None = None) -> tuple[dict, dict]:
    """The sampled walk over a whole evaluation: `parts` = [(p [K, T], valid [K, T], first_pos [T]
    or None)] per sequence. Draws `repeats` per sequence (seeded: the same figures on a rerun),
    then, while the AL's standard error is at or above `target_se`, as many more as the error says
    are needed (at most `max_repeats` in all). Returns (merged counts, {"repeats", "walk_se"}).
    `reach` (optional): another draft's p [K, T] per part (`oracle_probs`), walked over the same
    draws, the same uniforms included (a step both drafts' p accept is accepted in both: their
    ratio is not blurred by two draws' noise); its merged counts come as the second dict's "reach"."""
    if not parts:
        return merge([]), {"repeats": 0, "walk_se": 0.0, **({"reach": merge([])} if reach is not None else {})}
    gen = torch.Generator().manual_seed(seed)
    stats, draws, done, batch, other = [], [], 0, repeats, []
    while True:
        per = []
        for i, (p, v, fp) in enumerate(parts):
            state = gen.get_state() if reach is not None else None
            per.append(sampled_acceptance(p, v, batch, gen, fp, edges))
            if reach is not None:  # the same shapes from the same state: the same uniforms, then the same state
                gen.set_state(state)
                other.append(sampled_acceptance(reach[i], v, batch, gen, fp, edges)[0])
        stats += [c for c, _ in per]
        draws.append(sum(d for _, d in per))  # draw r of every sequence: one replica of the evaluation
        done += batch
        se = walk_error(torch.cat(draws))
        if se < target_se or done >= max_repeats:
            break
        batch = min(max_repeats - done, int(done * ((se / target_se) ** 2 - 1)) + 1)
    return merge(stats), {"repeats": done, "walk_se": se, **({"reach": merge(other)} if reach is not None else {})}
