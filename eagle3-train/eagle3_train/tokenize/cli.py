"""01c: raw responses of 01b -> the tokenized training set (what `01b --tokenize` also runs).

    uv run eagle3-train/01c_tokenize.py --raw-dir runs/gen --tokenizer moonshotai/Kimi-K2.5

Writes <output-dir>/data.jsonl ({id, input_ids, loss_mask, stats}) and its manifest (stage
`01c_tokenize`), through the one tokenization module. Prints how many answers mismatched (returned ids
vs re-wrapped text), were truncated to --max-seq-len, or were dropped, and why.
"""

from __future__ import annotations

import argparse
import sys

from eagle3_train.common.errors import run_main
from eagle3_train.tokenize.config import TokenizeConfig, add_tokenization_args


def parse_args(argv=None) -> TokenizeConfig:
    C = TokenizeConfig
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("input / output")
    g.add_argument("--raw-dir", **C.arg("raw_dir"))
    g.add_argument("--output-dir", **C.arg("output_dir"))
    g.add_argument("--progress-every", type=float, **C.arg("progress_every"))
    add_tokenization_args(p, C)
    return C.from_args(p.parse_args(argv))


def main(argv=None) -> int:
    cfg = parse_args(argv)
    from eagle3_train.tokenize import run

    run(cfg)
    return 0


def entry() -> None:
    """The numbered script's and the console script's entry: user mistakes are one `error:` line, exit 2."""
    sys.exit(run_main(main))


if __name__ == "__main__":
    entry()
