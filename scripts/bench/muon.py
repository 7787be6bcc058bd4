"""Muon's step on this machine with bf16 (torch's) against fp32 orthogonalisation (04's on CPU), on
the hidden matrices of a one-layer Llama draft of each width (the benchmark draft's proportions:
MLP 3x wide, 32-wide heads, 4 query heads per key/value head, fc 3x wide in), in one process.

    uv run python scripts/bench/muon.py --widths 256,512,1024 --threads 1

Prints seconds per step for each dtype and their ratio (the speed-up of fp32 here).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from eagle3_train.train.muon import Muon


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--widths", default="256,512,1024", help="draft widths (default: 256,512,1024)")
    p.add_argument("--steps", type=int, default=2, help="timed steps per dtype after one warm-up (default: 2)")
    p.add_argument("--threads", type=int, default=1, help="(default: 1)")
    return p.parse_args(argv)


def draft_matrices(width: int) -> list[torch.nn.Parameter]:
    heads = width // 32
    kv = max(1, heads // 4) * 32
    shapes = [(width, width), (kv, width), (kv, width), (width, width),  # q, k, v, o
              (3 * width, width), (3 * width, width), (width, 3 * width),  # gate, up, down
              (width, 3 * width)]  # fc over three aux layers
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=g) * 0.02) for s in shapes]


def time_step(params, dtype, steps: int) -> float:
    opt = Muon(params, lr=1e-3, adjust_lr_fn="match_rms_adamw", ns_dtype=dtype)
    g = torch.Generator().manual_seed(1)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    opt.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        opt.step()
    return (time.perf_counter() - t0) / steps


def main(argv=None) -> int:
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    print("| width | bf16 s/step | fp32 s/step | bf16 / fp32 |\n|---|---|---|---|")
    for w in (int(x) for x in a.widths.split(",")):
        params = draft_matrices(w)
        bf16 = time_step(params, torch.bfloat16, a.steps)
        fp32 = time_step(params, torch.float32, a.steps)
        print(f"| {w} | {bf16:.3f} | {fp32:.3f} | {bf16 / fp32:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
