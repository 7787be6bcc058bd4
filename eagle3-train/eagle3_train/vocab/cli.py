"""03: the draft vocabulary. Counts the supervised target tokens of the tokenized training set,
keeps the K most frequent (plus the tokens that end reasoning, turn and sequence), and writes
vocab_mapping.safetensors (d2t, t2d), the token counts, and a coverage report with its curve.

    uv run eagle3-train/03_build_vocab_mapping.py --data work/tokenized --target MODEL --output-dir work/vocab
"""

from __future__ import annotations

import argparse
import sys

from eagle3_train.common.errors import run_main
from eagle3_train.vocab.config import VocabConfig


def parse_args(argv=None) -> VocabConfig:
    C = VocabConfig
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("inputs")
    g.add_argument("--data", **C.arg("data"))
    g.add_argument("--target", **C.arg("target"))
    g.add_argument("--tokenizer", **C.arg("tokenizer"))
    g = p.add_argument_group("output")
    g.add_argument("--output-dir", "--out", **C.arg("output_dir"))
    g.add_argument("--overwrite", action="store_true", **C.arg("overwrite"))
    g.add_argument("--progress-every", type=float, **C.arg("progress_every"))
    g = p.add_argument_group("draft vocabulary")
    g.add_argument("--draft-vocab-size", type=int, **C.arg("draft_vocab_size"))
    g.add_argument("--keep-tokens", nargs="*", metavar="TOKEN", **C.arg("keep_tokens"))
    g.add_argument("--no-reasoning", action="store_true", **C.arg("no_reasoning"))
    g.add_argument("--think-start-id", type=int, **C.arg("think_start_id"))
    g.add_argument("--think-end-id", type=int, **C.arg("think_end_id"))
    g.add_argument("--end-of-turn-id", type=int, **C.arg("end_of_turn_id"))
    g = p.add_argument_group("coverage report")
    g.add_argument("--heldout-fraction", type=float, **C.arg("heldout_fraction"))
    g.add_argument("--coverage-sizes", type=int, nargs="+", metavar="K", **C.arg("coverage_sizes"))
    g = p.add_argument_group("token counts (token_freq.npy)")
    g.add_argument("--freq-from", metavar="DIR", **C.arg("freq_from"))
    g.add_argument("--recount", action="store_true", **C.arg("recount"))
    return C.from_args(p.parse_args(argv))


def main(argv=None) -> int:
    from eagle3_train.vocab import run

    return run(parse_args(argv))


def entry() -> None:
    """The numbered script's and the console script's entry: user mistakes are one `error:` line, exit 2."""
    sys.exit(run_main(main))


if __name__ == "__main__":
    entry()
