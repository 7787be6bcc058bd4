"""04's objective for the DFlash block draft (`--draft-arch dflash`): blocks anchored at supervised
positions of the packed batch, each slot's loss weighted by its place in the block.

Frames. A block anchored at shifted position j (anchor token ids[j] = token p) drafts tokens
p+1 .. p+K (K = block - 1) from its slots 1..K. Slot i is exactly what EAGLE-3's TTT step i-1 at
position j predicts, so the rows with a target (`prepare`'s `rows[i-1]`), the per-position loss
(Objective.position_loss: --loss ce or kl, dense or top-k targets) and the acceptance accounting
(acceptance.py's walk, through objective.batch_metrics) are the EAGLE-3 ones, unchanged: 04's
validation counts a block draft as vLLM does (its K greedy tokens accepted while they equal the
target's next tokens, AL = 1 + accepted / drafts, at the positions vLLM's walk drafts from).

Anchors. Training draws up to --block-anchors anchors per packed batch among the positions whose
next token is supervised (DFlash's and speculators' `select_anchors`: random anchors over the
supervised tokens, at most 512 a sequence), from torch's global RNG, which checkpoints save, so a
resumed run draws the same ones. Validation anchors a block at every such position (vLLM may draft
from any of them), in chunks of --block-anchors.

Weights. Slot i >= 1 weighs exp(-(i-1)/gamma): the DFlash paper's decay (the first draft token
matters most, each later one only if all before it are accepted), as speculators'
`dflash_loss_decay` (gamma 4.0 by default) and SpecForge's `loss_decay_gamma` (7 in its block-16
recipes) apply it. The loss is the weighted sum over the batch's slots divided by their count
(speculators' `loss_function`), so a step's batch loss does not depend on how the anchors split.
"""

from __future__ import annotations

import math

import torch

from eagle3_train.train.data import Batch
from eagle3_train.train.draft_dflash import run_blocks
from eagle3_train.train.objective import Objective


def slot_weights(block: int, gamma: float) -> list[float]:
    """The loss weight of draft slots 1..block-1: exp(-(i-1)/gamma)."""
    return [math.exp(-k / gamma) for k in range(block - 1)]


class BlockObjective(Objective):
    """The DFlash draft plus its block loss; forward returns what Objective's does (per-slot greedy
    draft ids [S], the loss, per-slot loss sums and counts), so the loop, the meter and the
    acceptance accounting stay the EAGLE-3 ones."""

    def __init__(self, draft, block: int, gamma: float, anchors: int, loss_impl: str, topk: bool,
                 tgt2draft: torch.Tensor | None, loss: str = "ce"):
        super().__init__(draft, block - 1, slot_weights(block, gamma), loss_impl, topk, tgt2draft, loss=loss)
        self.anchors = anchors

    def pick(self, b: Batch) -> torch.Tensor:
        """Sorted shifted positions to anchor blocks at: all with a next-token target (validation),
        or up to `anchors` of them drawn at random (training)."""
        cand = b.rows[0]
        if self.training and cand.numel() > self.anchors:
            keep = torch.randperm(cand.numel())[: self.anchors].to(cand.device)
            cand = cand[keep].sort().values
        return cand

    def forward(self, b: Batch):
        S, K = b.aux.shape[1], self.steps
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
            anchor_sets += [(a, e, mine[i:i + self.anchors]) for i in range(0, mine.numel(), self.anchors)]
        # No anchor at all (nothing supervised): one block whose loss counts nothing, so every
        # parameter is still in the graph (DDP).
        dummy = not anchor_sets
        if dummy:
            anchor_sets = [(0, S, torch.zeros(1, dtype=torch.long, device=device))]
        total = torch.zeros((), device=device)
        for a, e, chunk in anchor_sets:
            states = run_blocks(self.draft, b.aux[:, a:e], b.ids[:, a:e], b.pos[:, a:e], b.doc[a:e], chunk - a)
            if dummy:
                total = self.draft.lm_head(states[:1, -1]).sum() * 0.0
                break
            for k in range(K):
                sel = valid[k, chunk]
                if not sel.any():
                    continue
                rows = chunk[sel]
                lg = self.draft.lm_head(states[sel, k + 1])
                per, keep = self.position_loss(lg, b, rows + k)
                sums[k].append((per * keep).sum())
                cnts[k].append(keep.sum())
                preds[k][rows] = lg.detach().argmax(-1)
        loss_sum, loss_cnt = [], []
        weighted = []
        for k in range(K):
            s = torch.stack(sums[k]).sum() if sums[k] else torch.zeros((), device=device)
            n = torch.stack(cnts[k]).sum().float() if cnts[k] else torch.zeros((), device=device)
            weighted.append(self.weights[k] * s)
            loss_sum.append(s.detach().float())
            loss_cnt.append(n)
        total = total + torch.stack(weighted).sum() / torch.stack(loss_cnt).sum().clamp_min(1)
        if self.training:
            # Training drafts only at its sampled anchors: its acceptance counts them alone (the
            # every-position figures; the walk needs every position, which validation has).
            live = torch.zeros_like(b.full_ids, dtype=torch.bool)
            live[b.to_full[anchors[anchors < b.to_full.shape[0]]]] = True
            b.live = live if b.live is None else b.live & live
        return preds, total, {"loss_sum": torch.stack(loss_sum), "loss_cnt": torch.stack(loss_cnt)}
