"""The pilot: every stage on a small slice of the real run, before the real run, with the real
run's target, prompts and server flags. Each stage runs as its own process into <work-dir>/pilot;
01b's answers are screened for garbled output; one table says per stage ok/failed and its time,
the screen's verdict and 05's acceptance length (<work-dir>/pilot/pilot_report.{json,md}).

    uv run eagle3-train/pilot.py --target $MODEL --input mlabonne/open-perfectblend --work-dir $W \\
        --max-tokens 16384 --temperature 1.0 --tensor-parallel-size 8 --server-arg=--trust-remote-code
    uv run eagle3-train/pilot.py --screen-only $W/gen          # only the screen of an 01b output (running or finished)

01b asks a vLLM launched here on --target (stopped before 02, which launches its own with
--extract-backend vllm), or your running server (--base-url, --model). Rerunning the same command
resumes; a stage finished by another run's settings is refused. Exit codes: 0 every stage ran and
the screen says ok or warn; 1 a stage failed or the screen says garbled; 2 a bad flag.
"""

from __future__ import annotations

import argparse
import sys

from eagle3_train.common.config import join_dash_values
from eagle3_train.common.errors import run_main
from eagle3_train.pilot.config import BACKENDS, PilotConfig


def parse_args(argv=None) -> PilotConfig:
    C = PilotConfig
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("the real run")
    g.add_argument("--target", **C.arg("target"))
    g.add_argument("--input", **C.arg("input"))
    g.add_argument("--split", **C.arg("split"))
    g.add_argument("--work-dir", **C.arg("work_dir"))
    g.add_argument("--heldout-prompts", "--heldout", **C.arg("heldout_prompts"))  # --heldout: the older spelling
    g.add_argument("--tokenizer", **C.arg("tokenizer"))
    g.add_argument("--no-reasoning", action="store_true", **C.arg("no_reasoning"))

    g = p.add_argument_group("the pilot's sizes")
    g.add_argument("--pilot-prompts", type=int, **C.arg("pilot_prompts"))
    g.add_argument("--budget", **C.arg("budget"))
    g.add_argument("--eval-prompts", type=int, **C.arg("eval_prompts"))
    g.add_argument("--samples", type=int, **C.arg("samples"))

    g = p.add_argument_group("01b")
    g.add_argument("--base-url", **C.arg("base_url"))
    g.add_argument("--model", **C.arg("model"))
    g.add_argument("--max-tokens", type=int, **C.arg("max_tokens"))
    g.add_argument("--temperature", type=float, **C.arg("temperature"))
    g.add_argument("--concurrency", **C.arg("concurrency"))
    g.add_argument("--timeout", type=float, **C.arg("timeout"))

    g = p.add_argument_group("launched servers")
    g.add_argument("--max-model-len", type=int, **C.arg("max_model_len"))
    g.add_argument("--tensor-parallel-size", type=int, **C.arg("tensor_parallel_size"))
    g.add_argument("--reasoning-parser", **C.arg("reasoning_parser"))
    g.add_argument("--server-arg", action="append", **C.arg("server_arg", default=[]))
    g.add_argument("--startup-timeout", type=float, **C.arg("startup_timeout"))

    g = p.add_argument_group("02 to 05")
    g.add_argument("--extract-backend", choices=BACKENDS, **C.arg("extract_backend"))
    g.add_argument("--storage", **C.arg("storage"))
    g.add_argument("--draft-vocab-size", type=int, **C.arg("draft_vocab_size"))
    g.add_argument("--nproc-per-node", type=int, **C.arg("nproc_per_node"))
    g.add_argument("--stage-arg", action="append", **C.arg("stage_arg", default=[]))

    g = p.add_argument_group("screen only")
    g.add_argument("--screen-only", metavar="DIR", **C.arg("screen_only"))
    return C.from_args(p.parse_args(join_dash_values(sys.argv[1:] if argv is None else argv, ("--budget",))))


def main(argv=None) -> int:
    cfg = parse_args(argv)
    from eagle3_train.pilot import run

    return run(cfg)


def entry() -> None:
    """The shim's and the console script's entry: user mistakes are one `error:` line, exit 2."""
    sys.exit(run_main(main))


if __name__ == "__main__":
    entry()
