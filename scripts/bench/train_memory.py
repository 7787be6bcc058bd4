"""04's memory on CPU, part by part, against the planner's figure (planner.train_memory).

    uv run python scripts/bench/train_memory.py [--max-tokens 1024] [--ttt-steps 3] [--samples 64]

Builds 04's Trainer on the tiny trained target (tokenized -> 02 fp32 -> 03, as scripts/bench/train.py
does) and measures what its tensors hold, part by part (eagle3_testkit.train_memory: weights, grads +
AdamW states, the target head, activations). Prints each part planned / measured; exits 1 if the
total is off by more than --tolerance.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
from eagle3_testkit.bench_runs import training_inputs, write_json
from eagle3_testkit.train_memory import compare
from eagle3_train.train.cli import parse_args as train_args


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-tokens", type=int, default=1024, help="04's --max-tokens-per-batch (default: 1024)")
    p.add_argument("--ttt-steps", type=int, default=3, help="04's --ttt-steps (default: 3)")
    p.add_argument("--samples", type=int, default=64, help="samples to extract (default: 64)")
    p.add_argument("--tolerance", type=float, default=0.25, help="allowed |plan - measured| / measured (default: 0.25)")
    p.add_argument("--json", type=Path, default=None, help="also write the results here (default: no)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    from eagle3_testkit.fixtures import tiny_reasoner_dir

    target = tiny_reasoner_dir()
    with tempfile.TemporaryDirectory(prefix="bench_train_memory-") as tmp:
        work = Path(tmp)
        hs, vocab = training_inputs(work, target, args.samples)
        cfg = train_args(["--hidden-states", str(hs), "--vocab-mapping", str(vocab), "--target", str(target),
                          "--out", str(work / "run"), "--max-tokens-per-batch", str(args.max_tokens),
                          "--ttt-steps", str(args.ttt_steps), "--device", "cpu", "--quiet", "--threads", "1"])
        rows, flags = compare(cfg)
    for k, r in rows.items():
        ratio = f"{r['ratio']:.3f}" if r["ratio"] is not None else "-"
        print(f"{k:15s} planned {r['planned'] / 2**20:9.2f} MiB   measured {r['measured'] / 2**20:9.2f} MiB   "
              f"plan/measured {ratio}")
    print(f"batch {flags.max_tokens_per_batch} tokens, TTT {flags.ttt_steps}, attention {flags.attn}, "
          f"draft vocab {flags.draft_vocab_size}, storage {flags.storage}")
    write_json(args.json, {"rows": rows, "flags": vars(flags)})
    return 0 if abs(rows["total"]["ratio"] - 1) <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
