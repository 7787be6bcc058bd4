#!/usr/bin/env python3
"""The 01b client's own ceiling: requests/s from one pinned core against an instant local server.

    python scripts/bench/client.py                      # 5000 requests x 3 rounds, concurrency 256

An instant fake server (tests/fault_server.py --instant, the same canned vLLM-style answer to
every request) runs pinned to --server-core; each client variant runs in its own process pinned
to --client-core, in interleaved rounds, so load from elsewhere hits all of them alike. Reported:
median req/s, client CPU per request, and the ratio to a bare aiohttp client measured in the same
run (the most a Python client can do on that core). Variants:

  aiohttp-bare        aiohttp session.post + json.loads: the reference ceiling, not the SDK
  sdk-httpx-create    openai SDK as usually written: AsyncOpenAI().chat.completions.create
  sdk-aiohttp-create  the same with http_client=DefaultAioHttpClient()
  sdk-aiohttp-raw     DefaultAioHttpClient, client.post(cast_to=httpx2.Response), json.loads
  ours                eagle3_train.common.client.ChatClient.complete (what 01b runs: SDK post, raw body,
                      lean aiohttp transport, no telemetry headers, parse + retry bookkeeping)
  ours-xP             `ours` in P processes sharing the request count (--procs; on one pinned
                      core this shows what extra event loops cannot buy: the CPU is the limit)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

GOAL = 2000.0
VARIANTS = ("aiohttp-bare", "sdk-httpx-create", "sdk-aiohttp-create", "sdk-aiohttp-raw", "ours")
MESSAGES = [{"role": "user", "content": "What is 147 + 592?"}]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=5000, help="timed requests per variant and round (default: 5000)")
    p.add_argument("--warmup", type=int, default=500, help="untimed requests first (default: 500)")
    p.add_argument("--concurrency", type=int, default=256, help="requests in flight (default: 256)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the median is reported (default: 3)")
    p.add_argument("--client-core", type=int, default=0, help="CPU the client is pinned to (default: 0)")
    p.add_argument("--server-core", type=int, default=1, help="CPU the fake server is pinned to (default: 1)")
    p.add_argument("--procs", type=int, default=2, help="processes for the ours-xP variant; 0 = skip (default: 2)")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset (default: all)")
    p.add_argument("--json", type=Path, default=None, help="also write the results here (default: no)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--url", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- one variant (child)

async def _drive(one, n: int, warmup: int, concurrency: int) -> dict:
    sem = asyncio.Semaphore(concurrency)

    async def task():
        async with sem:
            await one()

    await asyncio.gather(*(task() for _ in range(warmup)))
    t0, c0 = time.perf_counter(), time.process_time()
    await asyncio.gather(*(task() for _ in range(n)))
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"requests": n, "wall_s": wall, "req_s": n / wall, "cpu_us_per_req": 1e6 * cpu / n}


async def child(variant: str, url: str, n: int, warmup: int, concurrency: int) -> dict:
    body = {"model": "fake", "messages": MESSAGES, "max_tokens": 64, "return_token_ids": True}
    payload = json.dumps(body).encode()
    if variant == "aiohttp-bare":
        import aiohttp

        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as s:
            async def one():
                async with s.post(url + "/chat/completions", data=payload,
                                  headers={"Content-Type": "application/json"}) as r:
                    d = json.loads(await r.read())
                    assert d["choices"][0]["token_ids"]
            return await _drive(one, n, warmup, concurrency)
    if variant.startswith("sdk-"):
        import httpx2
        import openai

        kw = {"http_client": openai.DefaultAioHttpClient()} if "aiohttp" in variant else {}
        client = openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0, **kw)
        if variant.endswith("create"):
            async def one():
                r = await client.chat.completions.create(model="fake", messages=MESSAGES, max_tokens=64,
                                                         extra_body={"return_token_ids": True})
                assert r.choices[0].model_extra["token_ids"]
        else:
            async def one():
                r = await client.post("/chat/completions", cast_to=httpx2.Response, content=payload,
                                      options={"headers": {"Content-Type": "application/json"}})
                assert json.loads(r.content)["choices"][0]["token_ids"]
        try:
            return await _drive(one, n, warmup, concurrency)
        finally:
            await client.close()
    if variant == "ours":
        from eagle3_train.common.client import ChatClient

        async with ChatClient([url], "fake", concurrency=concurrency, max_retries=0) as c:
            b = c.body(MESSAGES, {"max_tokens": 64})

            async def one():
                out = await c.complete(b)
                assert out.ok and out.answer["token_ids"], out.error
            return await _drive(one, n, warmup, concurrency)
    raise SystemExit(f"unknown variant {variant}")


# ----------------------------------------------------------------------------- driver

def pinned(core: int):
    return lambda: os.sched_setaffinity(0, {core})


def run_child(args, variant: str, url: str, n: int, concurrency: int) -> subprocess.Popen:
    cmd = [sys.executable, __file__, "--child", variant, "--url", url, "--requests", str(n),
           "--warmup", str(args.warmup), "--concurrency", str(concurrency)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, preexec_fn=pinned(args.client_core))


def measure(args, variant: str, url: str) -> dict:
    if variant.startswith("ours-x"):
        p = int(variant.split("x")[1])
        procs = [run_child(args, "ours", url, args.requests // p, max(1, args.concurrency // p)) for _ in range(p)]
        outs = [json.loads(pr.communicate()[0]) for pr in procs]
        # Each child times its own window; the aggregate is total requests over the longest window.
        wall = max(o["wall_s"] for o in outs)
        return {"req_s": sum(o["requests"] for o in outs) / wall,
                "cpu_us_per_req": statistics.mean(o["cpu_us_per_req"] for o in outs)}
    proc = run_child(args, variant, url, args.requests, args.concurrency)
    out, _ = proc.communicate()
    if proc.returncode:
        raise SystemExit(f"variant {variant} failed (exit {proc.returncode})")
    return json.loads(out)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(asyncio.run(child(args.child, args.url, args.requests, args.warmup, args.concurrency))))
        return 0
    from eagle3_testkit.bench_runs import write_json
    from eagle3_testkit.fixtures import REPO_ROOT
    from eagle3_train.common.vllm_server import free_port

    variants = [v for v in args.variants.split(",") if v]
    if args.procs > 1:
        variants.append(f"ours-x{args.procs}")
    port = free_port()
    server = subprocess.Popen([sys.executable, str(REPO_ROOT / "tests" / "fault_server.py"), "--port", str(port),
                               "--instant"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              preexec_fn=pinned(args.server_core))
    url = f"http://127.0.0.1:{port}/v1"
    try:
        for _ in range(200):
            try:
                urllib.request.urlopen(url + "/models", timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        results = {v: [] for v in variants}
        for _ in range(args.rounds):
            for v in variants:
                results[v].append(measure(args, v, url))
    finally:
        server.terminate()
        server.wait(10)
    med = {v: {"req_s": statistics.median(x["req_s"] for x in rs),
               "cpu_us_per_req": statistics.median(x["cpu_us_per_req"] for x in rs),
               "rounds_req_s": [round(x["req_s"]) for x in rs]} for v, rs in results.items()}
    bare = med.get("aiohttp-bare", {}).get("req_s")
    print(f"client pinned to CPU {args.client_core}, instant server on CPU {args.server_core}, "
          f"concurrency {args.concurrency}, {args.requests} requests x {args.rounds} rounds (median); "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"{'variant':<20} {'req/s':>8} {'CPU us/req':>11} {'vs bare':>8}   rounds")
    for v, m in med.items():
        ratio = f"{m['req_s'] / bare:.2f}" if bare else "-"
        print(f"{v:<20} {m['req_s']:>8.0f} {m['cpu_us_per_req']:>11.0f} {ratio:>8}   {m['rounds_req_s']}")
    if "ours" in med:
        ours = med["ours"]["req_s"]
        verdict = "met" if ours >= GOAL else "NOT met on this machine"
        line = f"goal >= {GOAL:.0f} req/s for the client on one core: {verdict} ({ours:.0f} req/s)"
        if bare:
            line += f"; ours = {ours / bare:.2f} x bare aiohttp in the same run"
        print(line)
    write_json(args.json, {"args": vars(args), "results": med})
    return 0


if __name__ == "__main__":
    sys.exit(main())
