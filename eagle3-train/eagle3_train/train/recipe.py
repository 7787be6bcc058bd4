"""04's optimizers: Muon on the hidden weight matrices (attention, MLP, fc), AdamW on the rest
(norms, and embed_tokens / lm_head when trained), as speculators groups them; and the step timing a
time budget (budget.py) is calibrated with."""

from __future__ import annotations

import time

import torch

from eagle3_train.train.muon import Muon

# names of 2-D parameters that stay with AdamW: vocabulary-sized lookups and heads (Muon practice)
ADAMW_MATRICES = ("embed_tokens", "lm_head")


def split_params(module: torch.nn.Module) -> tuple[list[tuple[str, torch.Tensor]], list[tuple[str, torch.Tensor]]]:
    """(Muon's, AdamW's) trainable named parameters: Muon takes the 2-D hidden weight matrices
    with both sides > 1, AdamW everything else (norms, biases, embed_tokens, lm_head)."""
    matrices, rest = [], []
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        if p.ndim == 2 and min(p.shape) > 1 and not any(h in name for h in ADAMW_MATRICES):
            matrices.append((name, p))
        else:
            rest.append((name, p))
    return matrices, rest


def build_optimizers(config, module: torch.nn.Module, cuda: bool, lr: float) -> list[torch.optim.Optimizer]:
    """[AdamW] or [Muon, AdamW] (the AdamW one omitted when nothing is left for it). Muon's lr is
    `lr` (--lr or the width rule, budget.choose_lr) with torch's `match_rms_adamw` adjustment (update RMS as AdamW's, so one lr serves
    both groups), momentum 0.95 and weight decay `--muon-weight-decay` (speculators' defaults)."""
    adamw = dict(lr=lr, betas=(config.beta1, config.beta2), weight_decay=config.weight_decay, eps=1e-8,
                 fused=cuda or None)
    if config.optimizer == "adamw":
        return [torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], **adamw)]
    matrices, rest = split_params(module)
    opts: list[torch.optim.Optimizer] = []
    if matrices:
        # bf16 orthogonalisation on a GPU (torch's); fp32 on a CPU, where bf16 matmuls crawl (muon.py)
        opts.append(Muon([p for _, p in matrices], lr=lr, momentum=0.95,
                         weight_decay=config.muon_weight_decay, adjust_lr_fn="match_rms_adamw",
                         ns_dtype=torch.bfloat16 if cuda else torch.float32))
    if rest:
        opts.append(torch.optim.AdamW([p for _, p in rest], **adamw))
    return opts


def time_steps(step_fn, n: int) -> float:
    """Seconds per step over `n` calls of `step_fn(i)` after one untimed warm-up call."""
    step_fn(0)
    t0 = time.perf_counter()
    for i in range(1, n + 1):
        step_fn(i)
    return (time.perf_counter() - t0) / n
