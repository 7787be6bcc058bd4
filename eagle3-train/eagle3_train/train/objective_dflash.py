"""04's objective for the DFlash block draft (`--draft-arch dflash`): blocks anchored at supervised
positions of the packed batch, each slot's loss weighted by its place in the block.

Frames. A block anchored at shifted position j (anchor token ids[j] = token p) drafts tokens
p+1 .. p+K (K = block - 1) from its slots 1..K. Slot i is exactly what EAGLE-3's TTT step i-1 at
position j predicts, so the rows with a target (`prepare`'s `rows[i-1]`), the per-position loss
(Objective.position_loss: --loss ce or kl, dense or top-k targets) and the acceptance accounting
(acceptance.py's walk, through objective.batch_metrics) are the EAGLE-3 ones, unchanged: 04's
validation counts a block draft as vLLM does (its K greedy tokens accepted while they equal the
target's next tokens, AL = 1 + accepted / drafts, at the positions vLLM's walk drafts from).

Anchors. Training draws anchors among the positions whose next token is supervised, per sequence
(--block-anchors: a count, or a share of the sequence's supervised positions, as speculators'
density-based selection does per conversation), or by default 512 over the whole packed batch (a
long sequence then gets fewer per token than in a batch of short ones), from torch's global RNG,
which checkpoints save, so a resumed run draws the same ones. Validation anchors a block at every
such position (vLLM may draft from any of them), 512 at a time, each block what vLLM runs at the K
it serves (the export's num_speculative_tokens): 1 + K queries, K slots counted; a block trained
longer than that is another forward there unless it is causal (--block-causal).

Weights (--block-loss). decay: slot i >= 1 weighs exp(-(i-1)/gamma), the DFlash paper's decay (the
first draft token matters most, each later one only if all before it are accepted), as speculators'
`dflash_loss_decay` (gamma 4.0 by default) and SpecForge's `loss_decay_gamma` (7 in its block-16
recipes) apply it. dpace: D-PACE, each block's own weights from its slots' confidences
(`dpace_weights`). The loss is the weighted sum over the batch's slots divided by their count
(speculators' `loss_function`), so a step's batch loss does not depend on how the anchors split.
"""

from __future__ import annotations

import math

import torch

from eagle3_train.train.config import BATCH_ANCHORS
from eagle3_train.train.data import Batch
from eagle3_train.train.draft_dflash import run_blocks
from eagle3_train.train.objective import Objective

DPACE_ALPHA = 0.5  # speculators' and SpecForge's smoothing of the per-slot confidence


def slot_weights(block: int, gamma: float) -> list[float]:
    """The loss weight of draft slots 1..block-1: exp(-(i-1)/gamma)."""
    return [math.exp(-k / gamma) for k in range(block - 1)]


def per_sequence(doc: torch.Tensor, anchors: float, keys: torch.Tensor) -> torch.Tensor:
    """bool [n]: which of n candidate anchors (sorted positions, `doc` their sequence) to keep: in
    each sequence the ones with the smallest random `keys`, `anchors` of them (a count), or that
    share of the sequence's candidates rounded, at least one (below 1)."""
    n = doc.numel()
    order = torch.argsort(keys)
    order = order[torch.argsort(doc[order], stable=True)]  # by sequence, random inside each
    counts = torch.bincount(doc - doc.min(), minlength=1)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.empty(n, dtype=torch.long, device=doc.device)
    rank[order] = torch.arange(n, device=doc.device) - starts[doc[order] - doc.min()]
    if anchors < 1:
        quota = torch.clamp((counts.double() * anchors).round().long(), min=1)
    else:
        quota = torch.clamp(counts, max=int(anchors))
    return rank < quota[doc - doc.min()]


def dpace_weights(loss: torch.Tensor, kept: torch.Tensor, alpha: float = DPACE_ALPHA) -> torch.Tensor:
    """D-PACE's weight [n, K] of each block's slots from their losses [n, K] (kept: the slots that
    count): slot k weighs the sum over counted slots j >= k of prod_{i <= j} ((1 - alpha) q_i + alpha),
    q = exp(-loss), the draft's smoothed chance of still being accepted at j; a slot that does not
    count passes 1 through the product and weighs 0 (speculators' `dpace_loss_decay`)."""
    with torch.no_grad():
        mask = kept.to(torch.float32)
        smooth = torch.where(kept, (1.0 - alpha) * torch.exp(-loss.float()) + alpha, torch.ones_like(mask))
        prefix = torch.cumprod(smooth, dim=-1)
        return torch.flip(torch.cumsum(torch.flip(prefix * mask, dims=[-1]), dim=-1), dims=[-1]) * mask


class BlockObjective(Objective):
    """The DFlash draft plus its block loss; forward returns what Objective's does (per-slot greedy
    draft ids [S], the loss, per-slot loss sums and counts), so the loop, the meter and the
    acceptance accounting stay the EAGLE-3 ones."""

    def __init__(self, draft, block: int, gamma: float, anchors: float | None, loss_impl: str, topk: bool,
                 tgt2draft: torch.Tensor | None, loss: str = "ce", serve: int | None = None,
                 block_loss: str = "decay"):
        super().__init__(draft, block - 1, slot_weights(block, gamma), loss_impl, topk, tgt2draft, loss=loss)
        self.anchors = anchors
        self.block_loss = block_loss
        # validation drafts what vLLM runs at the served K: blocks of 1 + K queries, K slots counted
        self.serve = serve or block - 1

    def pick(self, b: Batch) -> torch.Tensor:
        """Sorted shifted positions to anchor blocks at: all with a next-token target (validation),
        or (training) some of them drawn at random: `anchors` per sequence (a count, or below 1 a
        share of its candidates, at least one), or None: BATCH_ANCHORS over the whole packed batch."""
        cand = b.rows[0]
        if not self.training or not cand.numel():
            return cand
        if self.anchors is None:
            if cand.numel() > BATCH_ANCHORS:
                keep = torch.randperm(cand.numel())[:BATCH_ANCHORS].to(cand.device)
                cand = cand[keep].sort().values
            return cand
        return cand[per_sequence(b.doc[cand], self.anchors, torch.rand(cand.numel()).to(cand.device))]

    def forward(self, b: Batch):
        S, K = b.aux.shape[1], self.steps if self.training else self.serve
        device = b.aux.device
        anchors = self.pick(b)
        valid = torch.zeros(K, S, dtype=torch.bool, device=device)
        for k in range(K):
            valid[k, b.rows[k]] = True
        preds = [torch.zeros(S, dtype=torch.long, device=device) for _ in range(K)]
        sums = [[] for _ in range(K)]
        cnts = [[] for _ in range(K)]
        anchor_sets = []
        spans = b.spans or [(0, S)]
        for a, e in spans:  # nothing attends across samples: a group of them at a time
            mine = anchors[(anchors >= a) & (anchors < e)]
            anchor_sets += [(a, e, mine[i:i + BATCH_ANCHORS]) for i in range(0, mine.numel(), BATCH_ANCHORS)]
        # No anchor at all (nothing supervised): one block whose loss counts nothing, so every
        # parameter is still in the graph (DDP).
        dummy = not anchor_sets
        if dummy:
            anchor_sets = [(0, S, torch.zeros(1, dtype=torch.long, device=device))]
        total = torch.zeros((), device=device)
        weighted = []
        for a, e, chunk in anchor_sets:
            states = run_blocks(self.draft, b.aux[:, a:e], b.ids[:, a:e], b.pos[:, a:e], b.doc[a:e], chunk - a,
                                block=K + 1)
            if dummy:
                total = self.draft.lm_head(states[:1, -1]).sum() * 0.0
                break
            per_slot = torch.zeros(chunk.numel(), K, device=device)  # [anchors, slots]: each block's losses
            kept = torch.zeros(chunk.numel(), K, dtype=torch.bool, device=device)
            for k in range(K):
                sel = valid[k, chunk]
                if not sel.any():
                    continue
                rows = chunk[sel]
                lg = self.draft.lm_head(states[sel, k + 1])
                per, keep = self.position_loss(lg, b, rows + k)
                per_slot[sel, k] = per.float()
                kept[sel, k] = keep
                preds[k][rows] = lg.detach().argmax(-1)
            counted = per_slot * kept
            if self.block_loss == "dpace":
                w = dpace_weights(per_slot.detach(), kept)
            else:
                w = torch.tensor(self.weights[:K], device=device)
            weighted.append((counted * w).sum())
            for k in range(K):
                sums[k].append(counted[:, k].sum())
                cnts[k].append(kept[:, k].sum())
        loss_sum, loss_cnt = [], []
        for k in range(K):
            loss_sum.append(torch.stack(sums[k]).sum().detach().float() if sums[k] else torch.zeros((), device=device))
            loss_cnt.append(torch.stack(cnts[k]).sum().float() if cnts[k] else torch.zeros((), device=device))
        if weighted:
            total = total + torch.stack(weighted).sum() / torch.stack(loss_cnt).sum().clamp_min(1)
        if self.training:
            # Training drafts only at its sampled anchors: its acceptance counts them alone (the
            # every-position figures; the walk needs every position, which validation has).
            live = torch.zeros_like(b.full_ids, dtype=torch.bool)
            live[b.to_full[anchors[anchors < b.to_full.shape[0]]]] = True
            b.live = live if b.live is None else b.live & live
        return preds, total, {"loss_sum": torch.stack(loss_sum), "loss_cnt": torch.stack(loss_cnt)}
