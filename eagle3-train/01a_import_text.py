#!/usr/bin/env python3
"""01a: answers without token ids (reasoning/content text only) -> a 01b-format output directory.

    uv run eagle3-train/01a_import_text.py --input answers.jsonl --output-dir runs/gen \
        --tokenizer moonshotai/Kimi-K2.5 [--tokenize]

For answers from a server that returns no token ids (SGLang, a hosted API) or an earlier
raw_responses.jsonl with only `reasoning` / `content`. Each input line: `id` (optional),
`messages` | `conversations` | `prompt`, `reasoning` and/or `content`, `finish_reason` (optional,
stop/length). The ids are the tokenization module's re-wrap of the text (think-start + reasoning +
think-end + content + end-of-turn); every record and the manifest say `source: "text"`, so 01c, 02
and 03 take the directory unchanged and know what it is. Text cannot restore everything the target
emitted: a warning says what.
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
    g.add_argument("--input", required=True, help="JSONL of answers with reasoning/content and their prompts")
    g.add_argument("--output-dir", required=True, help="where raw_responses.jsonl and its manifest go")
    g.add_argument("--id-field", default=None,
                   help="field holding the sample id (default: id/prompt_id/conversation_id/uuid/idx, "
                        "else a hash of the conversation)")
    g.add_argument("--model", default=None,
                   help="the target that wrote the answers, recorded; also the default --tokenizer (default: none)")
    g.add_argument("--overwrite", action="store_true",
                   help="replace a 01b output in --output-dir, moving it aside into replaced-<time>/ "
                        "(default: refuse; an earlier import is simply rebuilt)")
    g.add_argument("--tokenize", action="store_true",
                   help="also write <output-dir>/tokenized/ as 01c_tokenize.py does (default: no)")
    add_tokenization_args(p)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from eagle3_train.text_import import import_text_answers
    from eagle3_train.tokenization import chat_format_from_args

    fmt = chat_format_from_args(args, default_tokenizer=args.model)
    name = args.tokenizer or args.model
    import_text_answers(Path(args.input), Path(args.output_dir), fmt, tokenizer_name=name, model=args.model,
                        id_key=args.id_field, overwrite=args.overwrite)
    if args.tokenize:
        from eagle3_train.dataset import build_training_set

        build_training_set(args.output_dir, Path(args.output_dir) / "tokenized", fmt, tokenizer_name=name,
                           max_seq_len=args.max_seq_len, loss_on=args.loss_on)
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
