"""04's grouped forwards (--group-tokens) with dense attention: training tokens/s of a step's
forward + backward at several group sizes, as a ratio to one forward over the whole batch, all in
one process on the same batches.

    uv run python scripts/bench/group_tokens.py [--hidden-states /work/bench/02 --vocab-mapping /work/bench/03
        --target assets/bench-reasoner] [--max-tokens 4096] [--groups 0,256,512,1024] [--steps 4] [--rounds 3]

Without --hidden-states it builds the tiny trained target's inputs (as scripts/bench/train.py does). The
settings take turns within each round, so the machine's drift hits them alike; each one's loss on
the same batches is printed beside one forward's, which it must equal up to rounding.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
from eagle3_testkit.bench_runs import training_inputs, write_json
from eagle3_train.train.cli import parse_args as train_args


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden-states", type=Path, default=None, help="an 02 store (default: build the tiny one)")
    p.add_argument("--vocab-mapping", type=Path, default=None, help="its 03 output (with --hidden-states)")
    p.add_argument("--target", type=Path, default=None, help="its target (with --hidden-states)")
    p.add_argument("--max-tokens", type=int, default=4096, help="04's --max-tokens-per-batch (default: 4096)")
    p.add_argument("--groups", default="0,256,512,1024", help="--group-tokens values, 0 = one forward "
                                                              "(default: 0,256,512,1024)")
    p.add_argument("--steps", type=int, default=4, help="steps timed per setting and round (default: 4)")
    p.add_argument("--rounds", type=int, default=3, help="rounds (default: 3)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads (default: 1)")
    p.add_argument("--json", type=Path, default=None, help="also write the results here (default: no)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    groups = [int(g) for g in args.groups.split(",")]
    from eagle3_train.train.dist import setup_dist
    from eagle3_train.train.inputs import open_inputs
    from eagle3_train.train.loop import Trainer

    with tempfile.TemporaryDirectory(prefix="bench_group_tokens-") as tmp:
        work = Path(tmp)
        if args.hidden_states is None:
            from eagle3_testkit.fixtures import tiny_reasoner_dir

            target = tiny_reasoner_dir()
            hs, vocab = training_inputs(work, target, 64)
        else:
            hs, vocab, target = args.hidden_states, args.vocab_mapping, args.target
        cfg = train_args(["--hidden-states", str(hs), "--vocab-mapping", str(vocab), "--target", str(target),
                          "--output-dir", str(work / "run"), "--max-tokens-per-batch", str(args.max_tokens),
                          "--device", "cpu", "--quiet", "--threads", str(args.threads)])
        d = setup_dist("cpu")
        trainer = Trainer(cfg, d, open_inputs(cfg, d.dtype), work / "run")
        batches = [trainer.loader.step(i) for i in range(args.steps)]
        tokens = sum(b.tokens for step in batches for b in step)
        secs = {g: 0.0 for g in groups}
        losses = {g: [] for g in groups}
        trainer.forward_backward(batches[0])  # warm-up, untimed
        for r in range(args.rounds):
            for g in groups:
                trainer.group_tokens = g or None
                t0 = time.perf_counter()
                for step in batches:
                    loss, _ = trainer.forward_backward(step)
                    for o in trainer.optimizers:
                        o.zero_grad(set_to_none=True)
                    if r == 0:
                        losses[g].append(loss)
                secs[g] += time.perf_counter() - t0
    base = groups[0]
    rows = {g: {"tokens_per_s": tokens * args.rounds / secs[g], "ratio": secs[base] / secs[g],
                "max_loss_rel_diff": max(abs(a - b) / abs(b) for a, b in zip(losses[g], losses[base], strict=True))}
            for g in groups}
    print(f"{args.steps} steps x {args.rounds} rounds of {args.max_tokens}-token batches ({tokens:,} tokens a "
          f"round), {args.threads} thread(s), TTT {cfg.ttt_steps}")
    for g, r in rows.items():
        print(f"--group-tokens {g:5d}: {r['tokens_per_s']:8.0f} tok/s   x{r['ratio']:.2f} of --group-tokens {base}   "
              f"loss max rel diff {r['max_loss_rel_diff']:.1e}")
    write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
