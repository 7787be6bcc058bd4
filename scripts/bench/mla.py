#!/usr/bin/env python3
"""The MLA draft head against the Llama head on the same DeepSeek-V3-style target, same data, same
budget (issue 16): 04 trains each (identical flags but --draft-arch), then 05 measures each
(offline walked AL on held-out stored samples, and vLLM's AL from its spec-decode counters, eagle3
arm, served bf16 through AMX_MLA on CPU).

    uv run python scripts/bench/mla.py --store DIR --vocab DIR --prompts heldout.jsonl [--target DIR]
        [--out /tmp/mla/bench] [--epochs 2] [--archs llama,mla] [--no-online]

The store and vocab are 02/03 outputs for the target (e.g. `scripts/demo.py --kimi-twin --quick`'s
02/ and 03/). Reported per arch: trainable and exported draft parameters, training tokens/s (median
of 04's logged steps; the ratio mla / llama is the figure, both runs in this one invocation, one
after the other, on the same machine), validation AL from 04, and 05's offline and vLLM AL. Writes
<out>/bench_mla.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

from eagle3_testkit.bench_runs import run_stage
from eagle3_train.common.errors import run_main


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--store", type=Path, required=True, help="02 output for the target")
    p.add_argument("--vocab", type=Path, required=True, help="03 output for the target")
    p.add_argument("--prompts", type=Path, required=True, help="held-out prompts for 05's vLLM arm")
    p.add_argument("--target", type=Path, default=None, help="target (default: the trained Kimi twin)")
    p.add_argument("--out", type=Path, default=Path("/tmp/mla/bench"), help="output root (default: %(default)s)")
    p.add_argument("--archs", default="llama,mla", help="draft archs, in run order (default: %(default)s)")
    p.add_argument("--epochs", type=int, default=2, help="04 epochs, the same for each arch (default: %(default)s)")
    p.add_argument("--max-tokens-per-batch", type=int, default=1024, help="04 batch tokens (default: %(default)s)")
    p.add_argument("--num-prompts", type=int, default=12, help="05 prompts (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=320, help="05 tokens per answer (default: %(default)s)")
    p.add_argument("--no-online", action="store_true", help="skip 05's vLLM arm (offline AL only)")
    p.add_argument("--report-only", action="store_true", help="no runs: the table from the runs already in --out")
    return p.parse_args(argv)


def params(export: Path) -> dict:
    from safetensors import safe_open

    with safe_open(str(export / "model.safetensors"), framework="pt") as f:
        sizes = {k: f.get_slice(k).get_shape() for k in f.keys()}  # noqa: SIM118 (safe_open)
    weights = [k for k in sizes if k not in ("d2t", "t2d")]
    core = [k for k in weights if not k.startswith(("embed_tokens", "lm_head"))]
    return {"export": sum(math.prod(sizes[k]) for k in weights),
            "without_embed_lm_head": sum(math.prod(sizes[k]) for k in core)}


def measure(d: Path) -> dict:
    """One arch's figures from its 04 and 05 directories. Throughput: 04's logged tokens per
    second of wall time (median over steps, first two left out) and per CPU-second of the training
    process (steadier on a shared machine)."""
    from eagle3_train.train.metrics import read_metrics

    train = read_metrics(d / "04")["train"]
    steady = train[2:] or train
    man = json.loads((d / "04" / "manifest.json").read_text())
    rep = json.loads((d / "05" / "report.json").read_text())
    spec = ((rep.get("online") or {}).get("arms", {}).get("eagle3") or {}).get("spec") or {}
    return {"params": params(d / "04" / "export"), "steps": man["counts"]["steps"],
            "train_tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady),
            "train_tokens_per_cpu_s": sum(r["tokens"] for r in steady) / sum(r["cpu_s"] for r in steady),
            "val_al": (man.get("best") or {}).get("acceptance_length"),
            "offline_al": (rep.get("offline") or {}).get("acceptance_length"),
            "vllm_al": spec.get("acceptance_length"), "vllm_drafts": spec.get("drafts")}


def main(argv=None) -> int:
    from eagle3_testkit.fixtures import kimi_twin_dir

    args = parse_args(argv)
    target = (args.target or kimi_twin_dir()).resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / "bench.log"
    rows = {}
    for arch in args.archs.split(","):
        d = args.out / arch
        if not args.report_only:
            run_stage("04_train.py", [
                "--hidden-states", args.store, "--vocab-mapping", args.vocab, "--target", target, "--output-dir",
                d / "04", "--draft-arch", arch, "--epochs", args.epochs, "--lr", "3e-3", "--ttt-steps", 3,
                "--num-speculative-tokens", 3, "--max-tokens-per-batch", args.max_tokens_per_batch, "--val-fraction",
                0.1, "--save-every", 50, "--warmup-steps", 10, "--log-every", 1, "--quiet"], log)
            evaluate = ["--draft", d / "04" / "export", "--target", target, "--store", args.store, "--output-dir",
                        d / "05", "--max-model-len", 1024]
            if not args.no_online:  # without prompts 05 runs the offline part only
                evaluate += ["--prompts", args.prompts, "--num-prompts", args.num_prompts, "--arms", "eagle3",
                             "--concurrency", 8, "--max-tokens", args.max_tokens,
                             "--server-arg=--dtype=bfloat16", "--server-arg=--attention-backend=AMX_MLA"]
            run_stage("05_evaluate.py", evaluate, log)
        rows[arch] = measure(d)
        (args.out / "bench_mla.json").write_text(json.dumps(rows, indent=2) + "\n")
    print("| head | params (export) | params w/o embed+lm_head | steps | train tok/s (wall, median) | tok/CPU-s "
          "| 04 val AL | 05 offline AL | vLLM AL (drafts) |\n|---|---|---|---|---|---|---|---|---|")
    for arch, r in rows.items():
        al = f"{r['vllm_al']:.3f} ({r['vllm_drafts']})" if r["vllm_al"] else "-"
        print(f"| {arch} | {r['params']['export']:,} | {r['params']['without_embed_lm_head']:,} | {r['steps']} | "
              f"{r['train_tokens_per_s']:.0f} | {r['train_tokens_per_cpu_s']:.0f} | {r['val_al'] or 0:.3f} | "
              f"{r['offline_al'] or 0:.3f} | {al} |")
    if {"llama", "mla"} <= set(rows):
        m, ll = rows["mla"], rows["llama"]
        print(f"training throughput mla / llama: {m['train_tokens_per_s'] / ll['train_tokens_per_s']:.2f} (wall), "
              f"{m['train_tokens_per_cpu_s'] / ll['train_tokens_per_cpu_s']:.2f} (CPU time)")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
