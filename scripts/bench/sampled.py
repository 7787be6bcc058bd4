"""Acceptance under sampling (temperature 1.0): 05's offline sampled walk against vLLM's own count.

    EAGLE3_VLLM_PYTHON=/work/main/.venv-vllm/bin/python \
        uv run python scripts/bench/sampled.py [--root /work/sampled] [--prompts 1000] [--heldout 200] \
        [--arm NAME=FLAGS ...] [--seeds 1,2]

  data   the benchmark target (assets/bench-reasoner) answers --prompts training questions at
         temperature --temperature in real vLLM (01b, tokenized) -> 02 (aux 1,3,4 + last) -> 03
  train  one draft per arm (04_train with FLAGS beyond the inputs; default arms: ce = 04's defaults,
         kl = --loss kl; both --val-temperature --temperature)
  eval   per arm and seed: vLLM serves the target with the draft (eagle3, k 3) at --temperature;
         01b answers the --heldout questions through it (vLLM's spec-decode counters around it:
         the online AL) -> 02 on those very answers -> 05's offline walks on them (sampled at
         --temperature, and greedy): the offline figures predict vLLM's on the same answers.
  cross  (not by default) every arm's draft walked offline on every arm's first-seed answers
Resumable: a finished step (its manifest, or the arm's eval-<seed>.json) is skipped on a rerun.
Results: <root>/results.json and results.md; stage output in <root>/sampled.log.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

from eagle3_testkit.bench_runs import AUX_LAYERS, BENCH_TARGET, DRAFT_VOCAB, HELDOUT_SEED, TRAIN_SEED, run_stage
from eagle3_testkit.bench_tasks import write_bench_prompts
from eagle3_train.common.errors import run_main
from eagle3_train.common.manifest import is_complete as complete
from eagle3_train.common.store import atomic_write_text
from eagle3_train.tokenize.dataset import STAGE as TOKENIZE_STAGE

DEFAULT_ARMS = {"ce": "", "kl": "--loss kl"}
K = 3


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", type=Path, default=Path("/work/sampled"), help="(default: /work/sampled)")
    p.add_argument("--target", type=Path, default=BENCH_TARGET, help=f"(default: {BENCH_TARGET})")
    p.add_argument("--temperature", type=float, default=1.0, help="generation and serving (default: 1.0)")
    p.add_argument("--prompts", type=int, default=1000, help="training prompts (default: 1000)")
    p.add_argument("--heldout", type=int, default=200, help="held-out prompts served per seed (default: 200)")
    p.add_argument("--max-tokens", type=int, default=400, help="per answer (default: 400)")
    p.add_argument("--arm", action="append", default=[], metavar="NAME=FLAGS",
                   help="04 flags of one arm (repeatable; replaces the defaults: ce=<none>, kl=--loss kl)")
    p.add_argument("--budget", default="150", help="04 --budget of every arm (default: 150 steps)")
    p.add_argument("--seeds", default="1,2", help="01b seeds of the served answers, one vLLM run each (default: 1,2)")
    p.add_argument("--repeats", type=int, default=64, help="the sampled walk's repeats (default: 64)")
    p.add_argument("--steps", default="data,train,eval",
                   help="which steps to run, of data,train,eval,cross (default: data,train,eval)")
    return p.parse_args(argv)


def gen_argv(prompts: Path, out: Path, base_url: str, args, seed: int) -> list:
    return ["--input", prompts, "--output-dir", out, "--base-url", base_url, "--model", "bench",
            "--concurrency", 32, "--max-tokens", args.max_tokens, "--temperature", args.temperature,
            "--seed", seed, "--timeout", 900, "--tokenize", "--tokenizer", args.target, "--progress-every", 0]


def data(args, root: Path, log: Path) -> None:
    from eagle3_train.common.vllm_server import VllmServer

    prompts, heldout = root / "prompts" / "train.jsonl", root / "prompts" / "heldout.jsonl"
    prompts.parent.mkdir(parents=True, exist_ok=True)
    write_bench_prompts(prompts, args.prompts, TRAIN_SEED)
    write_bench_prompts(heldout, args.heldout, HELDOUT_SEED)
    if not complete(root / "01b" / "tokenized", TOKENIZE_STAGE):
        with VllmServer(args.target, served_name="bench", max_model_len=1024, log_path=root / "vllm-01b.log") as srv:
            argv = gen_argv(prompts, root / "01b", srv.base_url, args, 0)
            if run_stage("01b_generate_synthetic.py", argv, log, ok=(0, 1)) == 1:
                run_stage("01b_generate_synthetic.py", argv, log)
    if not (root / "02" / "manifest.json").exists():
        run_stage("02_extract_hidden_states.py", ["--input", root / "01b" / "tokenized", "--model", args.target,
                                                  "--output-dir", root / "02", "--backend", "hf",
                                                  "--layers", AUX_LAYERS], log)
    if not (root / "03" / "manifest.json").exists():
        run_stage("03_build_vocab_mapping.py", ["--data", root / "01b" / "tokenized", "--target", args.target,
                                                "--output-dir", root / "03", "--draft-vocab-size", DRAFT_VOCAB], log)


def arms(args) -> dict[str, list[str]]:
    specs = dict(a.partition("=")[::2] for a in args.arm) if args.arm else DEFAULT_ARMS
    return {name: flags.split() for name, flags in specs.items()}


def train(args, root: Path, log: Path) -> None:
    for name, flags in arms(args).items():
        run = root / "arms" / name
        if not (run / "manifest.json").exists():
            run_stage("04_train.py", ["--hidden-states", root / "02", "--vocab-mapping", root / "03", "--target",
                                      args.target, "--output-dir", run, "--budget", args.budget,
                                      "--val-temperature", args.temperature, "--quiet", *flags], log)


def evaluate(args, root: Path, log: Path) -> dict:
    """Per arm and seed: vLLM's count over the held-out answers it made, and 05's walks on them."""
    from eagle3_train.common.hidden_store import HiddenStates
    from eagle3_train.common.vllm_server import VllmServer, scrape_metrics
    from eagle3_train.evaluate.draft import load_draft, load_target_head
    from eagle3_train.evaluate.offline import offline_eval
    from eagle3_train.evaluate.online import spec_counters, spec_delta

    results = {}
    for name in arms(args):
        run = root / "arms" / name
        val = json.loads((run / "manifest.json").read_text()).get("best") or {}
        for seed in (int(s) for s in args.seeds.split(",")):
            path = run / f"eval-{seed}.json"
            if path.exists():
                results[f"{name}/{seed}"] = json.loads(path.read_text())
                continue
            ev = run / f"eval-{seed}"
            spec = {"method": "eagle3", "model": str(run / "export"), "num_speculative_tokens": K}
            t0 = time.monotonic()
            with VllmServer(args.target, served_name="bench", speculative_config=spec, max_model_len=1024,
                            log_path=ev / "vllm.log") as srv:
                before = spec_counters(scrape_metrics(srv.metrics_url))
                run_stage("01b_generate_synthetic.py", gen_argv(root / "prompts" / "heldout.jsonl", ev / "gen",
                                                                srv.base_url, args, seed), log)
                online = spec_delta(before, spec_counters(scrape_metrics(srv.metrics_url)))
            serve_s = time.monotonic() - t0
            if not (ev / "02" / "manifest.json").exists():
                run_stage("02_extract_hidden_states.py", ["--input", ev / "gen" / "tokenized", "--model", args.target,
                                                          "--output-dir", ev / "02", "--backend", "hf",
                                                          "--layers", AUX_LAYERS], log)
            store = HiddenStates(ev / "02")
            model, head = load_draft(run / "export", args.target), load_target_head(args.target)
            sampled = offline_eval(model, head, store, store.ids, K, temperature=args.temperature,
                                   repeats=args.repeats)
            row = {"arm": name, "seed": seed, "val_al": val.get("acceptance_length"),
                   "online_al": online["acceptance_length"], "online_drafts": online["drafts"],
                   "online_per_position": online.get("per_position_rate"),
                   "offline_sampled_al": sampled["acceptance_length"], "offline_sampled_se": sampled.get("walk_se"),
                   "offline_sampled_per_position": sampled["cumulative"], "offline_drafts": sampled["drafts"],
                   "offline_greedy_al": sampled["greedy"]["acceptance_length"], "samples": sampled["samples"],
                   "serve_s": round(serve_s)}
            atomic_write_text(path, json.dumps(row, indent=2) + "\n")
            results[f"{name}/{seed}"] = row
            print(json.dumps(row), flush=True)
    return results


def cross(args, root: Path) -> dict:
    """Every arm's draft walked offline (sampled) on every arm's first-seed answers: the arms
    compared on the same answers (a paired comparison, without the answers' own spread)."""
    from eagle3_train.common.hidden_store import HiddenStates
    from eagle3_train.evaluate.draft import load_draft, load_target_head
    from eagle3_train.evaluate.offline import offline_eval

    seed, head, out = int(args.seeds.split(",")[0]), load_target_head(args.target), {}
    for answers in arms(args):
        store = HiddenStates(root / "arms" / answers / f"eval-{seed}" / "02")
        for name in arms(args):
            res = offline_eval(load_draft(root / "arms" / name / "export", args.target), head, store, store.ids, K,
                               temperature=args.temperature, repeats=args.repeats)
            out[f"{name} on {answers}'s answers"] = round(res["acceptance_length"], 4)
            print(f"{name} on {answers}'s answers: {res['acceptance_length']:.4f}", flush=True)
    return out


def table(results: dict) -> str:
    lines = ["| arm | seed | val AL (04) | vLLM AL (drafts) | 05 offline sampled AL (± se) | offline - vLLM "
             "| 05 offline greedy AL |", "|---|---|---|---|---|---|---|"]
    for r in results.values():
        lines.append(f"| {r['arm']} | {r['seed']} | {r['val_al'] or float('nan'):.3f} | {r['online_al']:.3f} "
                     f"({r['online_drafts']:.0f}) | {r['offline_sampled_al']:.3f} "
                     f"± {r['offline_sampled_se'] or 0:.3f} "
                     f"| {r['offline_sampled_al'] - r['online_al']:+.3f} | {r['offline_greedy_al']:.3f} |")
    by_arm: dict[str, list[float]] = {}
    for r in results.values():
        by_arm.setdefault(r["arm"], []).append(r["online_al"])
    for arm, als in by_arm.items():
        if len(als) > 1:  # the online figure's own noise: the spread of its seeds
            mean = sum(als) / len(als)
            sd = math.sqrt(sum((a - mean) ** 2 for a in als) / (len(als) - 1))
            lines.append(f"\n{arm}: vLLM AL over seeds {mean:.3f}, seed-to-seed sd {sd:.3f} "
                         f"(standard error of one seed's figure)")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args.target = args.target.resolve()
    root = args.root
    root.mkdir(parents=True, exist_ok=True)
    log = root / "sampled.log"
    steps = set(args.steps.split(","))
    if "data" in steps:
        data(args, root, log)
    if "train" in steps:
        train(args, root, log)
    if "eval" in steps:
        results = evaluate(args, root, log)
        atomic_write_text(root / "results.json", json.dumps(results, indent=2) + "\n")
        atomic_write_text(root / "results.md", table(results))
        print(table(results))
    if "cross" in steps:
        atomic_write_text(root / "cross.json", json.dumps(cross(args, root), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
