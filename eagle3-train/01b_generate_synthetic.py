#!/usr/bin/env python3
"""01b: regenerate the answers of a prompt set with the target served by vLLM (resumable).

    uv run eagle3-train/01b_generate_synthetic.py --input prompts.jsonl --output-dir runs/gen \
        --base-url http://127.0.0.1:8000/v1 --model kimi-k2.5 --concurrency 200 --max-tokens 16384

Rerunning the same command resumes (answered ids are skipped, failed ones retried). Exit codes:
0 all answered; 1 some ids still failed after retries (see errors.jsonl; rerun to retry them);
2 bad input or configuration; 130/143 stopped by Ctrl-C / SIGTERM (rerun to resume).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from eagle3_train.errors import run_main
from eagle3_train.tokenization import add_tokenization_args


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e.msg}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("input")
    g.add_argument("--input", required=True,
                   help="prompts: a .jsonl/.json file, a saved dataset dir, or a hub dataset name")
    g.add_argument("--split", default="train", help="dataset split (default: train)")
    g.add_argument("--dataset-config", default=None, help="dataset config name (default: none)")
    g.add_argument("--id-field", default=None,
                   help="field holding the sample id (default: id/prompt_id/conversation_id/uuid/idx, "
                        "else a hash of the conversation)")
    g.add_argument("--limit", type=int, default=None, help="use the first N prompts (default: all)")
    g.add_argument("--shard", default=None, help="I/N: this process takes shard I of N, by id hash (default: all)")
    g.add_argument("--skip-invalid", action="store_true",
                   help="count and skip malformed rows instead of stopping (default: stop with an error)")

    g = p.add_argument_group("output")
    g.add_argument("--output-dir", required=True, help="where raw_responses.jsonl etc. go")
    g.add_argument("--overwrite", action="store_true",
                   help="start over: move the previous output aside into replaced-<time>/ (default: resume)")
    g.add_argument("--progress-every", type=float, default=30.0,
                   help="seconds between lines in progress.log (default: 30)")

    g = p.add_argument_group("server")
    g.add_argument("--base-url", action="append", required=True,
                   help="OpenAI-compatible endpoint, e.g. http://host:8000/v1; repeat to spread load")
    g.add_argument("--model", required=True, help="served model name")
    g.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "EMPTY"),
                   help="API key; not stored in the manifest (default: $OPENAI_API_KEY, else EMPTY)")
    g.add_argument("--concurrency", type=int, default=64, help="requests in flight in total (default: 64)")
    g.add_argument("--timeout", type=float, default=3600.0,
                   help="seconds for one attempt, end to end; long reasoning needs minutes (default: 3600)")
    g.add_argument("--connect-timeout", type=float, default=30.0, help="seconds to connect (default: 30)")
    g.add_argument("--max-retries", type=int, default=5,
                   help="retries after timeouts, connection errors, 429 and 5xx (default: 5)")
    g.add_argument("--backoff-base", type=float, default=2.0,
                   help="first retry waits ~this many seconds, doubling each time (default: 2)")
    g.add_argument("--backoff-max", type=float, default=120.0, help="longest wait between retries (default: 120)")
    g.add_argument("--abort-after", type=int, default=64,
                   help="stop when this many samples in a row fail after retries; 0 = never (default: 64)")
    g.add_argument("--transport", choices=("aiohttp", "httpx"), default="aiohttp",
                   help="HTTP layer under the openai SDK (default: aiohttp)")
    g.add_argument("--no-preflight", action="store_true",
                   help="skip checking that each endpoint serves --model (default: check)")
    g.add_argument("--allow-text-fallback", action="store_true",
                   help="an answer without token ids (SGLang, a hosted API) gets ids re-wrapped from its "
                        "reasoning/content with --tokenizer, marked source=text and counted, as "
                        "01a_import_text.py does (default: refuse it; inexact, see 01a)")

    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=None, help="max generated tokens (default: up to the context)")
    g.add_argument("--temperature", type=float, default=None,
                   help="sampling temperature (default: the server's, i.e. the model's generation config)")
    g.add_argument("--top-p", type=float, default=None, help="nucleus sampling (default: server's)")
    g.add_argument("--seed", type=int, default=None,
                   help="base seed; each sample gets seed+hash(id) (default: unseeded)")
    g.add_argument("--extra-body", type=_json_object, default={},
                   help='JSON merged into every request, e.g. \'{"top_k": 20}\' (default: {})')

    g = p.add_argument_group("tokenize (same as 01c_tokenize.py)")
    g.add_argument("--tokenize", action="store_true",
                   help="also write <output-dir>/tokenized/ (training JSONL) when generation is done")
    k = g.add_mutually_exclusive_group()
    k.add_argument("--keep-length", dest="keep_length", action="store_true", default=True,
                   help="keep answers cut by --max-tokens (finish_reason=length) (default)")
    k.add_argument("--drop-length", dest="keep_length", action="store_false",
                   help="drop answers cut by --max-tokens")
    add_tokenization_args(p)  # its --chat-template-kwargs is sent to the server too
    args = p.parse_args(argv)
    for name in ("concurrency", "max_retries", "timeout"):
        if getattr(args, name) is None or getattr(args, name) < (1 if name == "concurrency" else 0):
            p.error(f"--{name.replace('_', '-')} must be positive")
    if not isinstance(args.chat_template_kwargs, dict):
        p.error("--chat-template-kwargs must be a JSON object")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from eagle3_train.generate import run_generation

    res = run_generation(args)
    if res.interrupted:
        print(f"01b stopped by {res.interrupted}: {res.answered}/{res.requested} answered so far; "
              "rerun the same command to resume", file=sys.stderr)
        return 143 if res.interrupted == "SIGTERM" else 130
    print(f"01b: {res.answered}/{res.requested} answered ({res.new_answers} this run, "
          f"{res.tokens} tokens), {res.failed} failed -> {Path(args.output_dir) / 'raw_responses.jsonl'}")
    if res.text_derived:
        from eagle3_train.text_import import text_warning

        print(text_warning(res.text_derived, res.answered), file=sys.stderr)
    if args.tokenize:
        from eagle3_train.dataset import build_training_set
        from eagle3_train.tokenization import chat_format_from_args

        fmt = chat_format_from_args(args, default_tokenizer=args.model)
        build_training_set(args.output_dir, Path(args.output_dir) / "tokenized", fmt,
                           tokenizer_name=args.tokenizer or args.model, max_seq_len=args.max_seq_len,
                           loss_on=args.loss_on, keep_length=args.keep_length,
                           progress_every=args.progress_every)
    if res.failed:
        print(f"{res.failed} ids failed after retries (reasons in errors.jsonl); "
              "rerun the same command to retry them", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
