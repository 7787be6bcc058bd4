"""04's objective: the draft unrolled for `ttt_steps` (training-time test) with a forward KL to
the target's distribution per step. Its forward returns (draft tokens, loss, metrics), so the loop
that calls it stays generic; acceptance is counted by the shared accounting of acceptance.py."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from eagle3_train.common.acceptance import (chain_acceptance, draft_correctness, merge, proposal_probs,
                                            sampled_acceptance)
from eagle3_train.common.positions import EDGES
from eagle3_train.train.data import Batch
from eagle3_train.train.draft_core import head, unroll


def alignment(b: Batch, steps: int) -> torch.Tensor:
    """valid [K, T]: step k drafting at unshifted t has a supervised target token t+1+k in the same
    document (the shared acceptance accounting decides; predictions do not matter here)."""
    dummy = [b.full_ids] * steps
    return draft_correctness(dummy, b.full_ids, b.full_mask, b.full_ids, b.full_doc)[1]


class Objective(nn.Module):
    """The draft plus its TTT loss: forward KL to the target's distribution over the draft vocab
    (dense target logits, or the stored top-k renormalised over the draft vocab), per-step weights."""

    def __init__(self, draft, steps: int, weights: list[float], loss_impl: str, topk: bool,
                 tgt2draft: torch.Tensor | None, loss: str = "kl"):
        super().__init__()
        self.loss = loss
        self.draft = draft
        self.steps = steps
        self.weights = weights
        self.topk = topk
        if tgt2draft is not None:
            self.register_buffer("tgt2draft", tgt2draft, persistent=False)
        else:
            self.tgt2draft = None
        if loss_impl == "fused":
            from speculators.losses.utils import kl_div_loss
        else:
            from speculators.losses.eager import kl_div_loss
        self.kl = kl_div_loss

    def position_loss(self, logits: torch.Tensor, b: Batch, rows: torch.Tensor):
        """Per-position loss [n] and which positions count [n] (top-k rows with no mass inside the
        draft vocab do not): forward KL, or (`ce`) cross-entropy on the target's most likely token
        in the draft vocab."""
        if not self.topk:
            if self.loss == "ce":
                return (torch.nn.functional.cross_entropy(logits.float(), b.targets[rows].argmax(-1), reduction="none"),
                        torch.ones_like(rows, dtype=torch.bool))
            return self.kl(logits[None], b.targets[rows][None])[0], torch.ones_like(rows, dtype=torch.bool)
        ids = b.topk_ids[rows]
        did = self.tgt2draft[ids] if self.tgt2draft is not None else ids
        inside = did >= 0
        p = torch.where(inside, b.topk_lp[rows].float().exp(), 0.0)
        mass = p.sum(-1, keepdim=True)
        p = p / mass.clamp_min(1e-12)
        if self.loss == "ce":  # the top-k ids are sorted: the first inside the draft vocab is its most likely
            first = torch.where(inside, torch.arange(ids.shape[-1], 0, -1, device=ids.device), 0).argmax(-1)
            top = did.gather(-1, first[:, None]).squeeze(-1).clamp_min(0)
            return (torch.nn.functional.cross_entropy(logits.float(), top, reduction="none"),
                    mass.squeeze(-1) > 0)
        logq = torch.log_softmax(logits.float(), -1).gather(-1, did.clamp_min(0))
        ent = torch.where(p > 0, p * p.clamp_min(1e-30).log(), 0.0).sum(-1)
        return ent - (p * logq).sum(-1), mass.squeeze(-1) > 0

    def forward(self, b: Batch):
        """(per-step greedy draft ids [S] (0 where step k has no target), the weighted loss,
        {"loss_sum": per-step loss sums [K], "loss_cnt": per-step counts [K]}). The head runs only
        on the rows that have a target: prompt tokens and document ends cost no lm_head. With
        `b.spans` the draft runs once per group of whole samples (nothing attends across samples,
        so the states are the same) and each step's loss is still the mean over the whole batch."""
        S = b.aux.shape[1]
        sums = [[] for _ in range(self.steps)]
        cnts = [[] for _ in range(self.steps)]
        preds = [torch.zeros(S, dtype=torch.long, device=b.aux.device) for _ in range(self.steps)]
        last = [None] * self.steps
        for a, e in b.spans or [(0, S)]:
            states = unroll(self.draft, b.aux[:, a:e], b.ids[:, a:e], b.pos[:, a:e], b.doc[a:e], self.steps,
                            states=True)
            for k, state in enumerate(states):
                last[k] = state
                rows = b.rows[k]
                if b.spans:  # rows are sorted: this group's are one slice of them
                    rows = rows[torch.searchsorted(rows, a):torch.searchsorted(rows, e)]
                if not rows.numel():
                    continue
                lg = head(self.draft, state[0, rows - a])
                per, keep = self.position_loss(lg, b, rows + k)
                sums[k].append((per * keep).sum())
                cnts[k].append(keep.sum())
                preds[k][rows] = lg.detach().argmax(-1)
        total = None
        loss_sum, loss_cnt = [], []
        for k in range(self.steps):
            if sums[k]:
                s, n = torch.stack(sums[k]).sum(), torch.stack(cnts[k]).sum()
                step_loss = s / n.clamp_min(1)
                loss_sum.append(s.detach().float())
                loss_cnt.append(n.float())
            else:
                step_loss = head(self.draft, last[k][0, :1]).sum() * 0.0  # every parameter in the graph (DDP)
                loss_sum.append(torch.zeros((), device=b.aux.device))
                loss_cnt.append(torch.zeros((), device=b.aux.device))
            term = self.weights[k] * step_loss
            total = term if total is None else total + term
        return preds, total, {"loss_sum": torch.stack(loss_sum), "loss_cnt": torch.stack(loss_cnt)}


def spans(doc: torch.Tensor, group: int) -> list[tuple[int, int]]:
    """[(start, end)] of a packed batch cut between samples into groups of at most `group` tokens
    (a longer sample is a group of its own), in order and covering it; padding (doc -1) goes with
    the group before it."""
    d = doc.tolist()
    starts = [j for j in range(len(d)) if j == 0 or (d[j] != d[j - 1] and d[j] != -1)] + [len(d)]
    out, a = [], 0
    for s, e in zip(starts[1:-1], starts[2:], strict=False):
        if e - a > group:  # the group ending at s is full: sample s..e starts the next one
            out.append((a, s))
            a = s
    out.append((a, len(d)))
    return out


def prepare(b: Batch, target_head, steps: int, group: int | None = None) -> Batch:
    """Targets and reference tokens from the frozen head (outside the wrapped model, so DDP never
    broadcasts the big lm_head), the per-step rows that carry a loss, and (`group`) the groups of
    whole samples the draft runs on one at a time."""
    if b.last is not None and target_head is not None:
        b.targets, ref_s = target_head.targets(b.last)
    else:
        ref_s = b.topk_ids[:, 0]
    n = b.to_full.shape[0]
    b.ref = torch.full_like(b.full_ids, -1)
    b.ref[b.to_full] = ref_s[:n]
    valid = alignment(b, steps)
    if b.live is not None:  # a window's context positions (and lookahead) are attended to, never trained
        valid &= b.live
    b.rows = [valid[k][b.to_full].nonzero().squeeze(1) for k in range(steps)]
    if group and b.aux.shape[1] > group:
        b.spans = spans(b.doc, group)
    return b


def first_drafted(b: Batch) -> torch.Tensor:
    """[T] the position in its own sample of the token a draft at unshifted t proposes first (t + 1):
    the sample's position ids, so a window or a later document of a packed row keeps its real one.
    Shifted j's input token is unshifted to_full[j]; a document's first token drafts nothing (-1 + 1)."""
    n = b.to_full.shape[0]
    pos = torch.full_like(b.full_ids, -1)
    pos[b.to_full] = b.pos[0, :n].to(pos.dtype)
    return pos + 1


def _correctness(b: Batch, preds: list[torch.Tensor], to_target: Callable) -> tuple[list, torch.Tensor, torch.Tensor]:
    """(proposals [T] a step in target ids, correct, valid [K, T]) of the draft's greedy tokens in the
    batch's unshifted frame."""
    full = []
    n = b.to_full.shape[0]
    for p in preds:
        f = torch.full_like(b.full_ids, -1)
        f[b.to_full] = to_target(p[:n])
        full.append(f)
    correct, valid = draft_correctness(full, b.full_ids, b.full_mask, b.ref, b.full_doc)
    if b.live is not None:
        valid &= b.live
    return full, correct, valid


def acceptance_stats(b: Batch, preds: list[torch.Tensor], to_target: Callable,
                     edges: Sequence[int] | None = None) -> dict:
    """Chain acceptance of the draft's greedy tokens against the target's, through the shared
    accounting (draft_correctness + chain_acceptance); with `edges`, by position too."""
    _, correct, valid = _correctness(b, preds, to_target)
    if edges is None:
        return chain_acceptance(correct, valid)
    return chain_acceptance(correct, valid, first_drafted(b), edges)


# Draws of the sampled validation walk per batch: its AL's Monte-Carlo error over a few hundred
# held-out samples stays well below the differences 04 selects on; the same seeds every validation,
# so two checkpoints are compared on the same draws.
VAL_DRAWS = 16


def sampled_stats(b: Batch, preds: list[torch.Tensor], to_target: Callable, target_head, temperature: float,
                  seed: int, edges: Sequence[int] | None = None, draws: int = VAL_DRAWS) -> dict:
    """`acceptance_stats` as vLLM verifies a sampled request: each proposal accepted with the target's
    probability of it at `temperature` (acceptance.sampled_acceptance, `draws` draws seeded by `seed`),
    from the last hidden state through the target's whole head, or the stored top-k. The counts
    are sums over the draws (their ratios are the figures)."""
    n = b.to_full.shape[0]
    full, _, valid = _correctness(b, preds, to_target)
    compact = torch.full_like(b.full_ids, -1)  # unshifted row -> the batch's row holding its state
    compact[b.to_full] = torch.arange(n, device=compact.device)

    def rows(a, e):  # unshifted row r: the target's distribution for token r + 1 (rows without one are never valid)
        i = compact[a:e].clamp_min(0)
        if b.last is not None and target_head is not None:
            return target_head.normed(b.last[i]) @ target_head.full.T, None
        return b.topk_lp[i], b.topk_ids[i]

    probs = proposal_probs(full, rows, temperature)
    gen = torch.Generator().manual_seed(seed)
    first = None if edges is None else first_drafted(b).cpu()
    counts, _ = sampled_acceptance(probs, valid.cpu(), draws, gen, first, edges or EDGES)
    return counts


def batch_metrics(b: Batch, draft_tokens: list[torch.Tensor], metrics: dict, to_target: Callable,
                  edges: Sequence[int] | None = None) -> dict:
    """One forward's numbers for the Meter: its metrics, real tokens and acceptance counts (by
    position too with `edges`: validation's)."""
    return {**metrics, "tokens": b.tokens, "chain": acceptance_stats(b, draft_tokens, to_target, edges)}


def combine(parts: list[dict]) -> dict:
    """The micro-batches of one step as one: sums, and acceptance counts merged."""
    loss_sum, loss_cnt = parts[0]["loss_sum"], parts[0]["loss_cnt"]
    for p in parts[1:]:
        loss_sum, loss_cnt = loss_sum + p["loss_sum"], loss_cnt + p["loss_cnt"]
    return {"loss_sum": loss_sum, "loss_cnt": loss_cnt, "tokens": sum(p["tokens"] for p in parts),
            "chain": merge([p["chain"] for p in parts])}
