"""01: a prompt source -> disjoint train and held-out prompt sets, before 01b answers any.

    uv run eagle3-train/01_split_prompts.py --input mlabonne/open-perfectblend --limit 100200 \\
        --heldout 200 --output-dir runs/prompts
    then 01b --input runs/prompts/train.jsonl, the pilot --input runs/prompts/train.jsonl,
    05 --prompts runs/prompts/heldout.jsonl

Reads the prompts as 01b's --input does (a .jsonl/.json file, a saved dataset dir or a hub
dataset name; the first --limit). --heldout N holds out N prompts, --heldout 0.01 a fraction; which
ones depends on the ids and --seed alone (the smallest blake2b(seed, id)), not on the file order.
Writes train.jsonl and heldout.jsonl (one {"id", "messages"} per line, in the source's order: 01b,
the pilot and 05 read them back with the same ids), then manifest.json. Rerunning with the same
settings leaves the split as it is; other settings are refused unless --overwrite (moves the old
split aside). 05 refuses --prompts whose ids the draft trained on.
"""

from __future__ import annotations

import argparse
import sys

from eagle3_train.common.errors import run_main
from eagle3_train.split_prompts.config import SplitConfig


def parse_args(argv=None) -> SplitConfig:
    C = SplitConfig
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("the prompts (as 01b's --input)")
    g.add_argument("--input", **C.arg("input"))
    g.add_argument("--split", **C.arg("split"))
    g.add_argument("--dataset-config", **C.arg("dataset_config"))
    g.add_argument("--id-field", **C.arg("id_field"))
    g.add_argument("--limit", type=int, **C.arg("limit"))

    g = p.add_argument_group("the split")
    g.add_argument("--heldout", type=float, **C.arg("heldout"))
    g.add_argument("--seed", type=int, **C.arg("seed"))

    g = p.add_argument_group("output")
    g.add_argument("--output-dir", **C.arg("output_dir"))
    g.add_argument("--overwrite", action="store_true", **C.arg("overwrite"))
    return C.from_args(p.parse_args(argv))


def main(argv=None) -> int:
    cfg = parse_args(argv)
    from eagle3_train.split_prompts import run

    return run(cfg)


def entry() -> None:
    """The numbered script's and the console script's entry: user mistakes are one `error:` line, exit 2."""
    sys.exit(run_main(main))


if __name__ == "__main__":
    entry()
