"""Retrain the Kimi-K2.5 twin on CPU and write its committed core (assets/kimi-twin-core).

    uv run python scripts/build_kimi_twin.py [--out assets/kimi-twin-core] [--steps 240] [--threads 2]

Trains the twin's DeepSeek-V3 text model on the synthetic reasoning tasks (eagle3_testkit.kimi_twin_train),
packages the full K2.5-style twin in a temp dir, keeps only its live vocabulary rows as the core, and
checks that assembling the core gives back the packaged twin tensor for tensor. Deterministic for a
seed, step count and thread count (the committed core: the defaults, 2 threads).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from eagle3_testkit.fixtures import KIMI_TWIN_CORE
from eagle3_train.common.store import TMP_PREFIX, atomic_dir_commit


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=KIMI_TWIN_CORE, help=f"core dir (default: {KIMI_TWIN_CORE})")
    p.add_argument("--steps", type=int, default=240, help="optimizer steps (default: 240)")
    p.add_argument("--seed", type=int, default=0, help="seed (default: 0)")
    p.add_argument("--threads", type=int, default=2, help="torch threads, part of determinism (default: 2)")
    return p.parse_args(argv)


def main(argv=None):
    import torch
    from eagle3_testkit.kimi_twin_train import assemble_kimi_twin, save_core, train_kimi_twin
    from safetensors.torch import load_file

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    work = args.out.parent / f"{TMP_PREFIX}{args.out.name}"
    shutil.rmtree(work, ignore_errors=True)
    stats = train_kimi_twin(work / "twin", steps=args.steps, seed=args.seed)
    save_core(work / "twin", work / "core")
    again = assemble_kimi_twin(work / "core", work / "again")
    a, b = load_file(work / "twin" / "model.safetensors"), load_file(again / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "the core does not rebuild the twin"
    atomic_dir_commit(work / "core", args.out)
    shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(stats, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
