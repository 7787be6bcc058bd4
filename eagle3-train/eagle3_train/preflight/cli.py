"""00_preflight: is this box ready? The GPUs (count, name, capability, memory), the driver against
the torch build, a timed all-reduce across every GPU under torchrun (a hang named, and retried with
NCCL_P2P_DISABLE=1), the vLLM build, disk free under the work dir against the plan, the model
folder complete, the tokenizer's special ids. One line per check: ok / warn / fail / skipped and
what to do; exit 1 on a fail, 2 on bad flags. Writes nothing unless --out.

    uv run eagle3-train/00_preflight.py --model /models/Kimi-K2.5 --work-dir runs --plan plan.json --gpus 8
    uv run eagle3-train/00_preflight.py --model MODEL_DIR --json --out runs/preflight.json
"""

from __future__ import annotations

import argparse
import sys

from eagle3_train.common.errors import run_main
from eagle3_train.preflight.config import PreflightConfig


def parse_args(argv=None) -> PreflightConfig:
    C = PreflightConfig
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    m = p.add_argument_group("the model")
    m.add_argument("--model", **C.arg("model"))
    m.add_argument("--tokenizer", **C.arg("tokenizer"))
    m.add_argument("--no-reasoning", action="store_true", **C.arg("no_reasoning"))

    d = p.add_argument_group("disk")
    d.add_argument("--work-dir", **C.arg("work_dir"))
    d.add_argument("--need-gb", type=float, **C.arg("need_gb"))
    d.add_argument("--plan", **C.arg("plan"))

    g = p.add_argument_group("GPUs and the all-reduce")
    g.add_argument("--gpus", type=int, **C.arg("gpus"))
    g.add_argument("--allreduce-procs", type=int, **C.arg("allreduce_procs"))
    g.add_argument("--allreduce-mb", type=float, **C.arg("allreduce_mb"))
    g.add_argument("--allreduce-iters", type=int, **C.arg("allreduce_iters"))
    g.add_argument("--allreduce-timeout", type=float, **C.arg("allreduce_timeout"))
    g.add_argument("--min-busbw", type=float, **C.arg("min_busbw"))

    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", **C.arg("json"))
    o.add_argument("--out", **C.arg("out"))
    return C.from_args(p.parse_args(argv))


def main(argv=None) -> int:
    config = parse_args(argv)
    from eagle3_train.preflight.runner import run

    return run(config)


def entry() -> None:
    """The numbered script's and the console script's entry: user mistakes are one `error:` line, exit 2."""
    sys.exit(run_main(main))


if __name__ == "__main__":
    entry()
