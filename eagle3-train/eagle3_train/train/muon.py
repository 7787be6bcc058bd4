"""torch's Muon with its Newton–Schulz orthogonalisation in a dtype of our choosing.

`torch.optim.Muon` always orthogonalises in bf16, which suits a GPU's tensor cores. A CPU without
bf16 matrix units (AVX2, or AVX-512 without AMX/avx512_bf16) multiplies bf16 at a small fraction of
its fp32 rate: on the 2-core AVX2 machines here 0.7 against 22 GFLOP/s, so a 1,024-wide draft's
step spent ~50 s in Muon, not ~5 s (`scripts/bench/train.py muon`). 04 orthogonalises in fp32 on CPU.

Everything else is torch's algorithm and state (`momentum_buffer`, the same param-group keys), so a
checkpoint made with torch's Muon resumes here and the reverse; with `ns_dtype=torch.bfloat16` a
step is bit-for-bit torch's (tests/test_muon.py).
"""

from __future__ import annotations

import math

import torch


def orthogonalize(update: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float,
                  dtype: torch.dtype) -> torch.Tensor:
    """The quintic Newton–Schulz iteration towards U·Vᵀ of `update` (its SVD U·S·Vᵀ), in `dtype`."""
    a, b, c = coefficients
    x = update.to(dtype)
    tall = update.size(0) > update.size(1)
    if tall:  # iterate on the wide side: the Gram matrix is the small one
        x = x.T
    x.div_(x.norm().clamp(min=eps))  # spectral norm <= Frobenius norm <= 1: inside the iteration's basin
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    return x.T if tall else x


def adjusted_lr(lr: float, fn: str | None, shape: torch.Size) -> float:
    """Muon's per-matrix lr: 'match_rms_adamw' gives an update of AdamW's RMS (0.2·sqrt(max(A, B)));
    'original' (torch's default) sqrt(max(1, A/B))."""
    rows, cols = shape[:2]
    if fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    if fn in (None, "original"):
        return lr * math.sqrt(max(1, rows / cols))
    return lr


class Muon(torch.optim.Muon):
    """torch.optim.Muon whose orthogonalisation runs in `ns_dtype` (torch's: bf16)."""

    def __init__(self, params, *, ns_dtype: torch.dtype = torch.bfloat16, **kwargs):
        super().__init__(params, **kwargs)
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr = float(group["lr"])
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - group["momentum"])
                update = p.grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf
                update = orthogonalize(update, group["ns_coefficients"], group["ns_steps"], group["eps"],
                                       self.ns_dtype)
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(update, alpha=-adjusted_lr(lr, group["adjust_lr_fn"], p.shape))
        return loss
