"""A Llama target lifted to a wider residual stream, computing what the original computes
(eagle3_testkit.widen): a rung of the width ladder behind 04's default lr (scripts/sweep_lr_width.py).

    uv run python scripts/build_wide_target.py --target assets/bench-reasoner --width 1024 \\
        --out /work/wide/target-1024 [--seed 0]

Then 02 over the same tokenized set gives the rung's store, e.g.
    uv run eagle3-train/02_extract_hidden_states.py --input /work/bench/01b/tokenized \\
        --model /work/wide/target-1024 --output-dir /work/wide/02-1024 --backend hf --layers 1,3,4
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from eagle3_train.common.errors import run_main


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", type=Path, required=True, help="a Llama checkpoint directory")
    p.add_argument("--width", type=int, required=True, help="the new hidden size (at least the target's)")
    p.add_argument("--out", type=Path, required=True, help="output directory (written whole or not at all)")
    p.add_argument("--seed", type=int, default=0, help="the random rotation's seed (default: 0)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    from eagle3_testkit.widen import widen_target

    a = parse_args(argv)
    print(f"wrote {widen_target(a.target, a.out, a.width, seed=a.seed)}")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
