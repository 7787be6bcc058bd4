"""01a: answers without token ids (reasoning/content text only) -> a 01b-format output directory.

    uv run eagle3-train/01a_import_text.py --input answers.jsonl --output-dir runs/gen \\
        --tokenizer moonshotai/Kimi-K2.5 [--tokenize]

For answers from a server that returns no token ids (SGLang, a hosted API) or an earlier
raw_responses.jsonl with only `reasoning` / `content`. Each input line: `id` (optional),
`messages` | `conversations` | `prompt`, `reasoning` and/or `content`, `finish_reason` (optional,
stop/length). The ids are the tokenization module's re-wrap of the text (think-start + reasoning +
think-end + content + end-of-turn); every record and the manifest say `source: "text"`, so 01c, 02
and 03 take the directory unchanged and know what it is. Text cannot restore everything the target
emitted: a warning says what. Rerunning with the same settings rebuilds the import; other
settings, or a 01b run's directory, are refused unless --overwrite (moves the old output aside).
"""

from __future__ import annotations

import argparse
import sys

from eagle3_train.common.errors import run_main
from eagle3_train.import_text.config import ImportTextConfig
from eagle3_train.tokenize.config import add_tokenization_args


def parse_args(argv=None) -> ImportTextConfig:
    C = ImportTextConfig
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("input / output")
    g.add_argument("--input", **C.arg("input"))
    g.add_argument("--id-field", **C.arg("id_field"))
    g.add_argument("--model", **C.arg("model"))
    g.add_argument("--output-dir", **C.arg("output_dir"))
    g.add_argument("--overwrite", action="store_true", **C.arg("overwrite"))
    g.add_argument("--progress-every", type=float, **C.arg("progress_every"))
    g.add_argument("--tokenize", action="store_true", **C.arg("tokenize"))
    add_tokenization_args(p, C)
    return C.from_args(p.parse_args(argv))


def main(argv=None) -> int:
    cfg = parse_args(argv)
    from eagle3_train.import_text import run

    return run(cfg)


def entry() -> None:
    """The numbered script's and the console script's entry: user mistakes are one `error:` line, exit 2."""
    sys.exit(run_main(main))


if __name__ == "__main__":
    entry()
