"""01b: regenerate the answers of a prompt set with the target served by vLLM (resumable).

    uv run eagle3-train/01b_generate_synthetic.py --input prompts.jsonl --output-dir runs/gen \\
        --base-url http://127.0.0.1:8000/v1 --model kimi-k2.5 --max-tokens 16384

Rerunning the same command resumes (answered ids are skipped, failed ones retried). Exit codes:
0 all answered; 1 some ids still failed after retries (see errors.jsonl; rerun to retry them);
2 bad input or configuration, or every request rejected for a reason no retry fixes (e.g. 400);
130/143 stopped by Ctrl-C / SIGTERM (rerun to resume). A run with no answer is never complete.
"""

from __future__ import annotations

import argparse
import json
import sys

from eagle3_train.common.config import join_dash_values
from eagle3_train.common.errors import run_main
from eagle3_train.common.server_wait import wait_seconds
from eagle3_train.generate.capture_settings import add_capture_args
from eagle3_train.generate.config import TRANSPORTS, GenerateConfig
from eagle3_train.tokenize.config import add_tokenization_args


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e.msg}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def parse_args(argv=None) -> GenerateConfig:
    C = GenerateConfig
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("input")
    g.add_argument("--input", **C.arg("input"))
    g.add_argument("--split", **C.arg("split"))
    g.add_argument("--dataset-config", **C.arg("dataset_config"))
    g.add_argument("--id-field", **C.arg("id_field"))
    g.add_argument("--limit", type=int, **C.arg("limit"))
    g.add_argument("--shard", **C.arg("shard"))
    g.add_argument("--skip-invalid", action="store_true", **C.arg("skip_invalid"))

    g = p.add_argument_group("output")
    g.add_argument("--output-dir", **C.arg("output_dir"))
    g.add_argument("--overwrite", action="store_true", **C.arg("overwrite"))
    g.add_argument("--progress-every", type=float, **C.arg("progress_every"))

    g = p.add_argument_group("server")
    g.add_argument("--base-url", action="append", **C.arg("base_url", default=None, required=False))
    g.add_argument("--model", **C.arg("model"))
    g.add_argument("--api-key", **C.arg("api_key"))
    g.add_argument("--concurrency", **C.arg("concurrency"))
    g.add_argument("--max-concurrency", type=int, **C.arg("max_concurrency"))
    g.add_argument("--concurrency-every", type=float, **C.arg("concurrency_every"))
    g.add_argument("--timeout", type=float, **C.arg("timeout"))
    g.add_argument("--connect-timeout", type=float, **C.arg("connect_timeout"))
    g.add_argument("--wait-for-server", type=wait_seconds, **C.arg("wait_for_server"))
    g.add_argument("--max-retries", type=int, **C.arg("max_retries"))
    g.add_argument("--backoff-base", type=float, **C.arg("backoff_base"))
    g.add_argument("--backoff-max", type=float, **C.arg("backoff_max"))
    g.add_argument("--abort-after", type=int, **C.arg("abort_after"))
    g.add_argument("--transport", choices=TRANSPORTS, **C.arg("transport"))
    g.add_argument("--no-preflight", action="store_true", **C.arg("no_preflight"))
    g.add_argument("--allow-text-fallback", action="store_true", **C.arg("allow_text_fallback"))

    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, **C.arg("max_tokens"))
    g.add_argument("--temperature", type=float, **C.arg("temperature"))
    g.add_argument("--top-p", type=float, **C.arg("top_p"))
    g.add_argument("--seed", type=int, **C.arg("seed"))
    g.add_argument("--extra-body", type=_json_object, **C.arg("extra_body"))

    g = p.add_argument_group("tokenize (same as 01c_tokenize.py)")
    g.add_argument("--tokenize", action="store_true", **C.arg("tokenize"))
    add_tokenization_args(p, C)  # its --chat-template-kwargs is sent to the server too
    add_capture_args(p, C)
    return C.from_args(p.parse_args(join_dash_values(sys.argv[1:] if argv is None else argv, ("--layers",))))


def main(argv=None) -> int:
    cfg = parse_args(argv)
    from eagle3_train.generate import run

    return run(cfg)


def entry() -> None:
    """The numbered script's and the console script's entry: user mistakes are one `error:` line, exit 2."""
    sys.exit(run_main(main))


if __name__ == "__main__":
    entry()
