"""02's speed measured (scripts/bench/extract.py speed and vllm, the GPU check's 02
step): tokenized sets of random tokens, and the hf backend's extraction tokens/s against a plain
forward over the same batches in the same process."""

from __future__ import annotations

import random
import shutil
import time
from pathlib import Path

import torch
from eagle3_train.common import hidden_store as hs
from eagle3_train.common.manifest import write_manifest
from eagle3_train.common.store import JsonlWriter
from eagle3_train.common.target import target_info
from eagle3_train.extract import hf as extract_hf
from eagle3_train.extract import stage as extract
from eagle3_train.tokenize.dataset import DATA
from eagle3_train.tokenize.dataset import STAGE as TOKENIZE_STAGE


def random_token_set(directory: Path, vocab: int, n: int, lo: int, hi: int, seed: int = 0,
                     tokenizer: dict | None = None) -> extract.InputSet:
    """A tokenized set of random token sequences (throughput does not care what the tokens say);
    `tokenizer` (manifest.describe_tokenizer) makes it acceptable to the stage itself."""
    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)
    with JsonlWriter(directory / DATA, fsync=False) as w:
        for i in range(n):
            L = rng.randint(lo, hi)
            w.write({"id": f"b{i:05d}", "input_ids": [rng.randrange(vocab) for _ in range(L)],
                     "loss_mask": [0] * (L // 4) + [1] * (L - L // 4), "stats": {}})
    write_manifest(directory, TOKENIZE_STAGE, config={"bench": True},
                   tokenizer=tokenizer or {"name_or_path": "random", "fingerprint": "random", "vocab_size": vocab})
    return extract.InputSet.open(directory)


class _Backend:  # the stage's backend interface around an already loaded target
    def __init__(self, target, batch_tokens):
        self.target, self.batch_tokens = target, batch_tokens

    def batches(self, records):
        return extract_hf.token_batches(records, self.batch_tokens, 1 << 30)

    def run(self, records):
        return self.target.run(records)


def _sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def extraction_speed(model_dir: Path, inp: extract.InputSet, *, storage: str, device: str, dtype: torch.dtype,
                     batch_tokens: int, topk: int, rounds: int, work: Path, shard_mb: float = 1.0) -> dict:
    """Tokens/s of 02's whole shard loop and of a plain forward over the same batches, their ratio
    (by wall and by CPU time, and against a full forward with logits), and the bytes per token."""
    info, cfg = target_info(str(model_dir))
    N, H = cfg.num_hidden_layers, cfg.hidden_size
    aux = extract.default_aux_layers(N)
    target = extract_hf.HFTarget(str(model_dir), num_layers=N, aux_ids=aux, storage=storage, topk=topk,
                                 dtype=dtype, device=device)
    plan = hs.make_plan([(sid, inp.lengths[sid]) for sid in inp.ids],
                        hs.shard_tokens_for(shard_mb, hs.bytes_per_token(storage, len(aux), H, topk)))
    # exactly the batches the stage makes: per shard, in plan order
    batches = [target.pad(b) for s in plan
               for b in extract_hf.token_batches(inp.records(s["ids"]), batch_tokens, 1 << 30)]
    tokens = sum(inp.lengths.values())

    def plain():
        target.remove_hooks()
        _sync(device)
        t0, c0 = time.perf_counter(), time.process_time()
        for ids, mask, _ in batches:
            target.forward(ids, mask)
        _sync(device)
        return time.perf_counter() - t0, time.process_time() - c0

    def full():
        target.remove_hooks()
        _sync(device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            for ids, mask, _ in batches:
                target.model(input_ids=ids.to(target.input_device),
                             attention_mask=None if mask is None else mask.to(target.input_device), use_cache=False)
        _sync(device)
        return time.perf_counter() - t0

    def extraction(r):
        target.install_hooks()
        out = work / f"{storage}-{r}"
        out.mkdir(parents=True)
        _sync(device)
        t0, c0 = time.perf_counter(), time.process_time()
        extract.extract_shards(_Backend(target, batch_tokens), inp, plan, out, storage=storage, aux_ids=aux,
                               N=N, index=hs.INDEX)
        _sync(device)
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        nbytes = sum(p.stat().st_size for p in out.glob("shard-*.safetensors"))
        shutil.rmtree(out)
        return dt, dc, nbytes

    plain()  # warm-up (allocator, kernels)
    tp, te, cp, ce, tf, nbytes = [], [], [], [], [], 0
    for r in range(rounds):  # alternate, so load changes on a shared machine hit both alike
        dt, dc = plain()
        tp.append(dt)
        cp.append(dc)
        tf.append(full())
        dt, dc, nbytes = extraction(r)
        te.append(dt)
        ce.append(dc)
    # Best of the rounds: other processes only ever add time. On a shared CPU the process-CPU-time
    # ratio is the steadier figure; on a GPU the wall-clock one is what counts.
    p, e = min(tp), min(te)
    return {"model": info["model_type"], "layers": N, "hidden": H, "storage": storage, "tokens": tokens,
            "batches": len(batches), "plain_tok_s": tokens / p, "extract_tok_s": tokens / e, "ratio": p / e,
            "ratio_cpu_time": min(cp) / min(ce), "ratio_vs_full_forward": min(tf) / e, "shards": len(plan),
            "rounds_wall_s": {"plain": tp, "full": tf, "extract": te},
            "bytes_per_token_measured": nbytes / tokens,
            "bytes_per_token_formula": hs.bytes_per_token(storage, len(aux), H, topk if storage == "fp8-topk" else 0)}
