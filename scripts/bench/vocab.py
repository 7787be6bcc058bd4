#!/usr/bin/env python3
"""Token counting for 03: the streaming bincount against per-token Python loops, same data, same run.

Synthetic training records at Kimi-K2.5's vocabulary size (163840), Zipf-distributed ids, prompt
tokens unmasked. Three counters, each checked to give identical counts:
  bincount   eagle3_train.vocab.mapping (per record: array + mask; one bincount per ~1M tokens)
  counter    a plain `for t, m in zip(ids, mask): if m: c[t] += 1` loop
  unique     speculators' way: per record torch.unique(return_counts) + Counter.update
Timed twice: from records already parsed (the counting alone) and end to end from data.jsonl
(JSON parsing included; ours also hashes the bytes it reads). Best of --repeats; ratios are what
to read, absolute figures depend on the machine's load.

    .venv/bin/python scripts/bench/vocab.py [--records 1000 --tokens 4000]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np
from eagle3_train.common.config import TOKENIZE
from eagle3_train.common.manifest import write_manifest
from eagle3_train.tokenize.dataset import TrainingSet
from eagle3_train.vocab import counts as vocab_counts


def make_records(n: int, length: int, v: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        ids = (rng.zipf(1.2, length) - 1) % v
        prompt = int(rng.integers(length // 10, length // 3))
        out.append({"id": f"b{i}", "input_ids": ids.tolist(),
                    "loss_mask": [0] * prompt + [1] * (length - prompt)})
    return out


def count_bincount(records, v):
    bins = vocab_counts._Bins(v)
    for rec in records:
        bins.add(vocab_counts.supervised_ids(rec, v, "bench"))
    bins.flush()
    return bins.counts


def count_counter(records, v):
    c = Counter()
    for rec in records:
        for t, m in zip(rec["input_ids"], rec["loss_mask"]):
            if m:
                c[t] += 1
    return _dense(c, v)


def count_unique(records, v):
    import torch

    c = Counter()
    for rec in records:
        ids = torch.tensor(rec["input_ids"])[torch.tensor(rec["loss_mask"]).bool()]
        u, n = ids.unique(return_counts=True)
        c.update(dict(zip(u.tolist(), n.tolist())))
    return _dense(c, v)


def _dense(c: Counter, v: int) -> np.ndarray:
    out = np.zeros(v, dtype=np.int64)
    if c:
        keys = np.fromiter(c.keys(), dtype=np.int64, count=len(c))
        out[keys] = np.fromiter(c.values(), dtype=np.int64, count=len(c))
    return out


def from_file(counter):
    def run(path, v):
        with open(path, "rb") as f:
            return counter([json.loads(line) for line in f], v)
    return run


def best(fn, repeats: int, *args):
    times, result = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn(*args)
        times.append(time.perf_counter() - t0)
    return min(times), result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--records", type=int, default=1000, help="records (default: 1000)")
    p.add_argument("--tokens", type=int, default=4000, help="tokens per record (default: 4000)")
    p.add_argument("--vocab", type=int, default=163840, help="target vocab (default: 163840, Kimi-K2.5)")
    p.add_argument("--repeats", type=int, default=3, help="best of N (default: 3)")
    args = p.parse_args()
    v = args.vocab
    records = make_records(args.records, args.tokens, v, 0)
    sup = sum(sum(r["loss_mask"]) for r in records)
    print(f"{args.records} records x {args.tokens} tokens, {sup:,} supervised, vocab {v}")

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "data.jsonl"
        with open(path, "w") as f:
            for r in records:
                f.write(json.dumps(r, separators=(",", ":")) + "\n")
        write_manifest(Path(tmp), TOKENIZE, config={"bench": True})  # what makes it a tokenized set
        rows = [
            ("counting only", "bincount", count_bincount, (records, v)),
            ("counting only", "counter", count_counter, (records, v)),
            ("counting only", "unique", count_unique, (records, v)),
            ("from data.jsonl", "bincount",
             lambda pth, vv: vocab_counts.count_tokens(TrainingSet(pth.parent), vv, 0.1)[0].total,
             (path, v)),
            ("from data.jsonl", "counter", from_file(count_counter), (path, v)),
            ("from data.jsonl", "unique", from_file(count_unique), (path, v)),
        ]
        results = {}
        for what, name, fn, fargs in rows:
            t, counts = best(fn, args.repeats, *fargs)
            results[(what, name)] = (t, counts)
        print(f"file: {path.stat().st_size / 1e6:.1f} MB")

    ref = results[("counting only", "counter")][1]
    for (what, name), (_, counts) in results.items():
        assert np.array_equal(counts, ref), f"{what}/{name} counts differ"
    for what in ("counting only", "from data.jsonl"):
        tb = results[(what, "bincount")][0]
        for name in ("bincount", "counter", "unique"):
            t = results[(what, name)][0]
            print(f"{what:16s} {name:9s} {sup / t / 1e6:8.2f} M supervised tok/s  "
                  f"bincount is {t / tb:5.2f}x faster")
    print("all three counters agree exactly")


if __name__ == "__main__":
    main()
