"""Benchmark 02_extract_hidden_states (hf backend).

  1. extraction tokens/s divided by a plain forward pass's tokens/s, on the same model, the same
     batches, in the same process (goal >= 0.9). "Extraction" is the stage's whole shard loop:
     reading the input, batching, the forward with the capture hooks, unpadding, encoding and
     writing the shards. "Plain" is the same decoder forward with the hooks removed, nothing kept
     (strict: extraction may not even compute logits); "full" is the whole CausalLM forward with
     logits for every position (what fp8-topk needs anyway).
  2. bytes per token of each storage option, measured on the tiny target's shards and computed
     for Kimi-K2.5 (hidden 7168, aux layers 2/30/58).

  uv run python scripts/bench/extract.py                         # CPU, tiny llama + deepseek_v3
  uv run python scripts/bench/extract.py --device cuda --samples 256 --max-len 2048 --batch-tokens 65536
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from eagle3_testkit.bench_runs import write_json
from eagle3_testkit.extract_speed import extraction_speed, random_token_set
from eagle3_train.common import hidden_store as hs
from eagle3_train.common.target import target_info
from eagle3_train.extract import hf as extract_hf

KIMI = {"hidden": 7168, "layers": 61, "aux": [2, 30, 58]}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", nargs="+", default=["llama", "deepseek_v3"], help="tiny targets (default: both)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    p.add_argument("--dtype", default="auto", help="compute dtype (default: auto = bf16 on GPU, fp32 on CPU)")
    p.add_argument("--samples", type=int, default=16, help="samples (default: 16)")
    p.add_argument("--min-len", type=int, default=64, help="shortest sample (default: 64)")
    p.add_argument("--max-len", type=int, default=384, help="longest sample (default: 384)")
    p.add_argument("--batch-tokens", type=int, default=4096, help="batch budget (default: 4096)")
    p.add_argument("--storages", nargs="+", default=["bf16", "fp8", "fp8-topk"],
                   help="storage options to time (default: bf16 fp8 fp8-topk)")
    p.add_argument("--topk", type=int, default=32, help="k for fp8-topk (default: 32)")
    p.add_argument("--rounds", type=int, default=4, help="alternating timed rounds, best taken (default: 4)")
    p.add_argument("--shard-mb", type=float, default=1.0,
                   help="shard size; several shards let writes overlap compute as in a real run (default: 1)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads on CPU; 1 keeps timings steady on a shared machine, where "
                        "spinning OpenMP threads burn and blur CPU time (default: 1)")
    p.add_argument("--json", type=Path, default=None, help="also write the results here (default: no)")
    return p.parse_args(argv)


def kimi_sizes(storages, topk) -> list[dict]:
    bf16 = hs.bytes_per_token("bf16", 3, KIMI["hidden"])
    out = []
    for s in dict.fromkeys(["bf16", *storages, "fp8", "fp8-topk"]):
        b = hs.bytes_per_token(s, 3, KIMI["hidden"], topk if s == "fp8-topk" else 0)
        out.append({"storage": s, "bytes_per_token": b, "share_of_bf16": b / bf16,
                    "TB_per_100M_tokens": b * 1e8 / 1e12})
    return out


def main(argv=None):
    args = parse_args(argv)
    from eagle3_testkit.fixtures import random_target_dir

    device = extract_hf.resolve_device(args.device)
    dtype = extract_hf.resolve_dtype(args.dtype, device)
    if device == "cpu" and args.threads:
        torch.set_num_threads(args.threads)
    results = []
    with tempfile.TemporaryDirectory(prefix="bench_extract-") as tmp:
        tmp = Path(tmp)
        for arch in args.arch:
            model_dir = random_target_dir(arch)
            _, cfg = target_info(str(model_dir))
            inp = random_token_set(tmp / f"in-{arch}", cfg.vocab_size, args.samples, args.min_len, args.max_len)
            for storage in args.storages:
                results.append(extraction_speed(model_dir, inp, storage=storage, device=device, dtype=dtype,
                                                batch_tokens=args.batch_tokens, topk=args.topk,
                                                rounds=args.rounds, work=tmp / "work", shard_mb=args.shard_mb))
                r = results[-1]
                print(f"{r['model']:12s} {r['storage']:9s} plain {r['plain_tok_s']:9.0f} tok/s  extract "
                      f"{r['extract_tok_s']:9.0f} tok/s  ratio {r['ratio']:.3f} (goal >= 0.9; "
                      f"by CPU time {r['ratio_cpu_time']:.3f}; vs full forward {r['ratio_vs_full_forward']:.3f})  "
                      f"bytes/token {r['bytes_per_token_measured']:.1f} (formula {r['bytes_per_token_formula']})",
                      flush=True)
    kimi = kimi_sizes(args.storages, args.topk)
    print(f"\nKimi-K2.5 (hidden {KIMI['hidden']}, aux {KIMI['aux']} + last {KIMI['layers']}), top-k {args.topk}:")
    for k in kimi:
        print(f"  {k['storage']:9s} {k['bytes_per_token']:7d} bytes/token  {100 * k['share_of_bf16']:5.1f}% of bf16"
              f"  {k['TB_per_100M_tokens']:.2f} TB per 100M tokens")
    summary = {"device": device, "dtype": str(dtype), "torch_threads": torch.get_num_threads(),
               "config": vars(args), "tiny": results, "kimi_k25": kimi}
    write_json(args.json, summary)
    return summary


if __name__ == "__main__":
    main()
