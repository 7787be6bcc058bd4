"""Regenerate the bundled tiny trained target (assets/tiny-reasoner) on CPU.

    uv run python scripts/build_tiny_target.py [--out assets/tiny-reasoner] [--steps 800] [--seed 0]

Deterministic for a given seed, step count and thread count: the committed weights were made with
the defaults and torch.set_num_threads(1). The result is written to a temp dir and moved into place.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from eagle3_testkit.fixtures import TINY_REASONER
from eagle3_testkit.tiny_target import train_tiny_target
from eagle3_train.common.store import TMP_PREFIX, atomic_dir_commit


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=TINY_REASONER, help=f"output dir (default: {TINY_REASONER})")
    p.add_argument("--steps", type=int, default=800, help="optimizer steps (default: 800)")
    p.add_argument("--batch", type=int, default=32, help="sequences per step (default: 32)")
    p.add_argument("--seed", type=int, default=0, help="seed (default: 0)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    p.add_argument("--tokenizer", type=Path, default=None,
                   help="use this tokenizer dir instead of building it (default: build, seeded)")
    p.add_argument("--threads", type=int, default=1, help="torch threads, part of determinism (default: 1)")
    return p.parse_args(argv)


def main(argv=None):
    import torch

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    tmp = args.out.parent / f"{TMP_PREFIX}{args.out.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    stats = train_tiny_target(tmp, steps=args.steps, batch=args.batch, seed=args.seed,
                              device=args.device, tokenizer_dir=args.tokenizer)
    atomic_dir_commit(tmp, args.out)
    print(json.dumps(stats, indent=2))


if __name__ == "__main__":
    main()
