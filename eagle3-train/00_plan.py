#!/usr/bin/env python3
"""00: plan a run before anything runs: per stage the disk, the per-GPU memory (04 at its batch,
02's top-k head, 05's offline head), the tokens and the hours from tok/s rates (measured where
marked, else assumed; --rate-02 etc. override). Writes nothing.

    python eagle3-train/00_plan.py --target docs/kimi-k2.5-text-config.json --samples 100000 \\
        --tokens-per-sample 10000 --gpus 8 --gpu-memory-gb 96
    python eagle3-train/00_plan.py --target MODEL_DIR --data work/tokenized --storage fp8-topk --json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from eagle3_train.errors import PipelineError, run_main


def load_shape(target: str):
    from eagle3_train.planner import Shape

    path = Path(target)
    if path.is_file():  # a config.json (a wrapper's text_config is used when present)
        cfg = json.loads(path.read_text())
        return Shape.from_config(cfg.get("text_config", cfg))
    from eagle3_train.manifest import text_config
    from eagle3_train.target import load_target_config

    return Shape.from_config(text_config(load_target_config(target)))


def measure_data(directory: str) -> tuple[int, float, int]:
    """(samples, mean tokens per sample, data.jsonl bytes) of a tokenized set, from its manifest."""
    from eagle3_train.manifest import read_manifest

    d = Path(directory)
    counts = (read_manifest(d) or {}).get("counts") or {}
    if not counts.get("samples"):
        raise PipelineError(f"--data {d}: no manifest with sample counts (a finished 01c output)")
    return counts["samples"], counts["tokens"] / counts["samples"], (d / "data.jsonl").stat().st_size


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="target model dir/name or a config JSON file")
    p.add_argument("--data", help="a tokenized set (01c output): its real sample count and lengths")
    p.add_argument("--samples", type=int, default=100000, help="samples (default: 100000; --data overrides)")
    p.add_argument("--tokens-per-sample", type=float, default=10000.0, help="mean tokens per sample (default: 10000)")
    p.add_argument("--storage", default="bf16", choices=("bf16", "fp16", "fp32", "fp8", "fp8-topk"),
                   help="02's --storage (default: bf16)")
    p.add_argument("--topk", type=int, default=32, help="02's --topk for fp8-topk (default: 32)")
    p.add_argument("--n-aux", type=int, default=3, help="auxiliary layers (default: 3)")
    p.add_argument("--draft-vocab-size", type=int, default=32000, help="03's draft vocabulary (default: 32000)")
    p.add_argument("--max-tokens-per-batch", type=int, default=4096, help="04's batch (default: 4096)")
    p.add_argument("--ttt-steps", type=int, default=3, help="04's TTT steps (default: 3)")
    p.add_argument("--epochs", type=int, default=None,
                   help="04's epochs (default: 04's rule, the fewest that reach 1,000 steps, at most 10)")
    p.add_argument("--draft-arch", default="auto", choices=("auto", "llama", "mla"),
                   help="04's --draft-arch (default: auto, the MLA layer for an MLA target)")
    p.add_argument("--attn", default="flex", choices=("flex", "sdpa", "eager"), help="04's attention (default: flex)")
    p.add_argument("--train-embeddings", action="store_true", help="04 trains embed_tokens (default: frozen)")
    p.add_argument("--train-lm-head", action="store_true", help="04 trains lm_head (default: frozen)")
    p.add_argument("--gpus", type=int, default=8, help="GPUs (default: 8)")
    p.add_argument("--gpu-memory-gb", type=float, default=96.0, help="memory per GPU (default: 96)")
    for stage in ("01b", "02", "04", "05"):
        p.add_argument(f"--rate-{stage}", type=float, help=f"{stage}'s tok/s over all GPUs (default: see the table)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON instead of the table")
    return p.parse_args(argv)


def main(argv=None) -> int:
    from eagle3_train.planner import Flags, plan, table

    a = parse_args(argv)
    samples, per_sample, measured = a.samples, a.tokens_per_sample, None
    if a.data:
        samples, per_sample, measured = measure_data(a.data)
    flags = Flags(samples=samples, tokens_per_sample=per_sample, storage=a.storage, topk=a.topk, n_aux=a.n_aux,
                  draft_vocab_size=a.draft_vocab_size, max_tokens_per_batch=a.max_tokens_per_batch,
                  ttt_steps=a.ttt_steps, epochs=a.epochs, draft_arch=a.draft_arch, attn=a.attn,
                  train_embeddings=a.train_embeddings,
                  train_lm_head=a.train_lm_head, gpus=a.gpus, gpu_memory_gb=a.gpu_memory_gb,
                  tokenized_bytes=measured,
                  rates={s: getattr(a, f"rate_{s}") for s in ("01b", "02", "04", "05")})
    result = plan(load_shape(a.target), flags)
    print(json.dumps(result, indent=1) if a.json else table(result))
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
