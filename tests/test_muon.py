"""04's Muon (train/muon.py): torch's algorithm and state, its orthogonalisation in a chosen dtype."""

from __future__ import annotations

import copy

import pytest
import torch
from eagle3_train.train.muon import Muon, orthogonalize

COEFFS = (3.4445, -4.7750, 2.0315)  # torch's default quintic


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in ((48, 16), (16, 48), (32, 32))]


def _run(opt_cls, params, steps: int, seed: int = 1, **kw) -> torch.optim.Optimizer:
    opt = opt_cls(params, **kw)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return opt


@pytest.mark.parametrize("adjust", ["match_rms_adamw", "original"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_bf16_steps_are_torchs_bit_for_bit(adjust, nesterov):
    ours, theirs = _params(), _params()
    kw = dict(lr=3e-3, momentum=0.95, weight_decay=0.1, nesterov=nesterov, adjust_lr_fn=adjust)
    _run(Muon, ours, 5, ns_dtype=torch.bfloat16, **kw)
    _run(torch.optim.Muon, theirs, 5, **kw)
    for a, b, start in zip(ours, theirs, _params(), strict=True):
        assert torch.equal(a, b) and not torch.equal(a, start)


def test_a_torch_muon_checkpoint_resumes_here():
    """The same state keys: torch's optimizer state loads into ours and the run continues as torch's
    would have (bf16), and ours loads into torch's."""
    base = _params()
    kw = dict(lr=1e-2, momentum=0.95, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    theirs = _run(torch.optim.Muon, base, 3, **kw)
    p_ours, p_theirs = copy.deepcopy(base), copy.deepcopy(base)
    ours = Muon(p_ours, ns_dtype=torch.bfloat16, **kw)
    ours.load_state_dict(copy.deepcopy(theirs.state_dict()))  # (a load shares the saved tensors)
    again = torch.optim.Muon(p_theirs, **kw)
    again.load_state_dict(copy.deepcopy(ours.state_dict()))
    g = torch.Generator().manual_seed(7)
    for _ in range(2):
        grads = [torch.randn(p.shape, generator=g) for p in base]
        for ps, opt in ((p_ours, ours), (p_theirs, again)):
            for p, gr in zip(ps, grads, strict=True):
                p.grad = gr.clone()
            opt.step()
    for a, b in zip(p_ours, p_theirs, strict=True):
        assert torch.equal(a, b)


def test_fp32_orthogonalisation_is_the_iteration_without_bf16_rounding():
    """fp32 follows the exact (fp64) iteration ~1e5x closer than bf16 does, and both give an update
    whose singular values lie in the iteration's band (~0.7-1.2), the property Muon relies on."""
    g = torch.Generator().manual_seed(3)
    for shape in ((64, 24), (24, 64), (40, 40)):
        u = torch.randn(shape, generator=g, dtype=torch.float64)
        exact = orthogonalize(u, COEFFS, 5, 1e-7, torch.float64)
        e32 = (orthogonalize(u, COEFFS, 5, 1e-7, torch.float32).double() - exact).abs().max().item()
        e16 = (orthogonalize(u, COEFFS, 5, 1e-7, torch.bfloat16).double() - exact).abs().max().item()
        assert e32 < 1e-5 < 1e-3 < e16
        for dtype in (torch.float32, torch.bfloat16):
            s = torch.linalg.svdvals(orthogonalize(u, COEFFS, 5, 1e-7, dtype).double())
            assert s.min() > 0.6 and s.max() < 1.25, (dtype, s.min(), s.max())


def test_fp32_and_bf16_runs_train_alike():
    """A few steps on a least-squares problem: fp32 orthogonalisation reaches the loss bf16 does
    (the dtype is a speed choice, not a different optimizer)."""
    g = torch.Generator().manual_seed(5)
    x, w_true = torch.randn(256, 32, generator=g), torch.randn(16, 32, generator=g)
    y = x @ w_true.T
    losses = {}
    for dtype in (torch.float32, torch.bfloat16):
        w = torch.nn.Parameter(torch.zeros(16, 32))
        opt = Muon([w], lr=1.0, momentum=0.9, weight_decay=0.0, adjust_lr_fn="original", ns_dtype=dtype)
        for i in range(60):
            opt.param_groups[0]["lr"] = 1.0 - i / 60  # linear decay: Muon's steps are of fixed size
            opt.zero_grad()
            loss = (x @ w.T - y).pow(2).mean()
            loss.backward()
            opt.step()
        losses[dtype] = loss.item()
    start = y.pow(2).mean().item()
    assert losses[torch.float32] < 0.05 * start and losses[torch.bfloat16] < 0.05 * start
    assert abs(losses[torch.float32] - losses[torch.bfloat16]) < 0.02 * start
