#!/usr/bin/env python3
"""01c: raw responses of 01b -> the tokenized training set (what `01b --tokenize` also runs).

    uv run eagle3-train/01c_tokenize.py --raw-dir runs/gen --tokenizer moonshotai/Kimi-K2.5

Writes <output-dir>/data.jsonl ({id, input_ids, loss_mask, stats}) and its manifest (stage
`tokenize`), through the one tokenization module. Prints how many answers mismatched (returned ids
vs re-wrapped text), were truncated to --max-seq-len, or were dropped, and why.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from eagle3_train.errors import run_main
from eagle3_train.tokenization import add_tokenization_args


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("input / output")
    g.add_argument("--raw-dir", required=True, help="output directory of 01b (with raw_responses.jsonl)")
    g.add_argument("--output-dir", default=None, help="where data.jsonl goes (default: <raw-dir>/tokenized)")
    g.add_argument("--progress-every", type=float, default=30.0,
                   help="seconds between lines in progress.log (default: 30)")
    g = p.add_argument_group("selection")
    k = g.add_mutually_exclusive_group()
    k.add_argument("--keep-length", dest="keep_length", action="store_true", default=True,
                   help="keep answers cut by max_tokens (finish_reason=length) (default)")
    k.add_argument("--drop-length", dest="keep_length", action="store_false",
                   help="drop answers cut by max_tokens")
    add_tokenization_args(p)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from eagle3_train.dataset import RAW_STAGE, build_training_set
    from eagle3_train.manifest import read_manifest
    from eagle3_train.tokenization import chat_format_from_args

    raw = read_manifest(Path(args.raw_dir), RAW_STAGE)
    recorded = raw.get("config", {})
    # Render with the template kwargs the answers were generated with, unless told otherwise.
    if not args.chat_template_kwargs and recorded.get("chat_template_kwargs"):
        args.chat_template_kwargs = recorded["chat_template_kwargs"]
    name = args.tokenizer or recorded.get("tokenizer") or recorded.get("model")
    fmt = chat_format_from_args(args, default_tokenizer=name)
    out = Path(args.output_dir) if args.output_dir else Path(args.raw_dir) / "tokenized"
    build_training_set(args.raw_dir, out, fmt, tokenizer_name=name, max_seq_len=args.max_seq_len,
                       loss_on=args.loss_on, keep_length=args.keep_length, progress_every=args.progress_every)
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
