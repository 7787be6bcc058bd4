#!/usr/bin/env python3
"""GPU check for 04_train (run by hand on a CUDA box; < 2 minutes on one H200).

    uv run python scripts/gpu_check_04.py --out gpu_check_04.json

On the bundled tiny trained target (assets/tiny-reasoner; else the seeded random tiny Llama), it
makes the inputs with the pipeline itself (tokenize -> 02 hf on CUDA -> 03), then trains the draft
twice on CUDA with bf16 autocast:
  fast   the CUDA defaults (with --loss kl): compiled flex attention + speculators' fused Triton KL loss
  eager  sdpa attention + eager KL (the CPU paths, on the GPU)
and records training tokens/s of each (steps after the first two, which compile), whether both
follow the same loss trajectory (same batches, same init), the validation acceptance estimate,
and wall times. Exit code 0 only if both runs finish, losses are finite and the two trajectories
agree within bf16 tolerance (first step within 2%, every step within 10%); the speed-up of the
fast path over the eager one is recorded, not required (a tiny draft is launch-bound).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="results JSON path")
    p.add_argument("--samples", type=int, default=400, help="synthetic samples (default: 400)")
    p.add_argument("--max-tokens", type=int, default=4096, help="tokens per packed batch (default: 4096)")
    p.add_argument("--ttt-steps", type=int, default=7, help="TTT steps (default: 7)")
    p.add_argument("--steps", type=int, default=30, help="training steps per run (default: 30)")
    return p.parse_args(argv)


def load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def train_once(work: Path, hs: Path, vocab: Path, target: Path, args, name: str, extra: list[str]) -> dict:
    from eagle3_train.train import run
    from eagle3_train.train.metrics import read_metrics

    out = work / name
    argv = ["--hidden-states", str(hs), "--vocab-mapping", str(vocab), "--target", str(target), "--out", str(out),
            "--max-tokens-per-batch", str(args.max_tokens), "--ttt-steps", str(args.ttt_steps),
            "--max-steps", str(args.steps), "--epochs", "50", "--val-fraction", "0.05", "--save-every",
            str(args.steps), "--log-every", "1", "--lr", "3e-3", "--device", "cuda", "--quiet", *extra]
    t0 = time.perf_counter()
    run(load(REPO / "eagle3-train" / "04_train.py", "stage_04").parse_args(argv))
    wall = time.perf_counter() - t0
    m = read_metrics(out)
    recs = m["train"][2:]  # the first steps compile kernels
    tokens = sum(r["tokens"] for r in recs)
    seconds = sum(r["tokens"] / r["tokens_per_s"] for r in recs)
    val = m.get("val", [{}])[-1]
    return {"wall_s": round(wall, 1), "tokens_per_s": tokens / seconds if seconds else None,
            "losses": [r["loss"] for r in m["train"]], "val_acceptance_length": val.get("acceptance_length"),
            "val_loss": val.get("loss")}


def check(args, work: Path) -> dict:
    """The inputs, then the fast and the eager run, in `work` (the fast draft's export stays at
    work/fast/export); their figures and whether the two loss trajectories agree."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device: this check needs a GPU")
    from eagle3_testkit.fixtures import TINY_REASONER, random_target_dir

    target = TINY_REASONER if (TINY_REASONER / "model.safetensors").exists() else random_target_dir("llama")
    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "target": str(target),
              "config": {k: v for k, v in vars(args).items() if k != "out"}}
    bench = load(REPO / "scripts" / "bench_train.py", "bench_train")
    t0 = time.perf_counter()
    hs, vocab = bench.make_inputs(work, target, args.samples)
    result["inputs_s"] = round(time.perf_counter() - t0, 1)
    kl = ["--loss", "kl"]  # the fused Triton kernel is the KL's (04's default, ce, is plain cross_entropy)
    fast = train_once(work, hs, vocab, target, args, "fast", kl)
    result["fast"] = fast
    eager = train_once(work, hs, vocab, target, args, "eager", [*kl, "--attn", "sdpa", "--loss-impl", "eager"])
    result["eager"] = eager
    finite = all(math.isfinite(x) for x in fast["losses"] + eager["losses"])
    gaps = [abs(a - b) / max(abs(b), 1e-6) for a, b in zip(fast["losses"], eager["losses"])]
    result["loss_rel_gap_first"] = gaps[0]
    result["loss_rel_gap_max"] = max(gaps)
    result["speedup_fast_over_eager"] = (fast["tokens_per_s"] or 0) / (eager["tokens_per_s"] or 1)
    result["ok"] = bool(finite and gaps[0] < 0.02 and max(gaps) < 0.10)
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    result: dict = {"ok": False}
    try:
        with tempfile.TemporaryDirectory(prefix="gpu_check_04-") as tmp:
            result = check(args, Path(tmp))
    except Exception as e:  # the record says what failed, for whoever runs this remotely
        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()[-4000:]
    result["total_s"] = round(time.perf_counter() - t_start, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    summary = {k: result.get(k) for k in ("ok", "device", "speedup_fast_over_eager", "loss_rel_gap_first",
                                          "loss_rel_gap_max", "total_s", "error")}
    summary["fast_tokens_per_s"] = (result.get("fast") or {}).get("tokens_per_s")
    summary["eager_tokens_per_s"] = (result.get("eager") or {}).get("tokens_per_s")
    print(json.dumps(summary, indent=2))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
