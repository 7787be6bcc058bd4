"""Draft quality on the benchmark (issue 13): speculators' own Trainer against our 04, same data,
both drafts served by real vLLM; acceptance length and the ratios printed.

    EAGLE3_VLLM_PYTHON=/work/main/.venv-vllm/bin/python \
        uv run python scripts/bench/quality.py [--root /work/bench] [--results /work/bench/results] \
        [--arm NAME=KIND:FLAGS ...] [--only NAME,NAME] [--num-prompts 100]

Needs scripts/bench/data.py's output under --root (02 store, 03 vocabulary, held-out prompts).
Each arm trains one draft, then 05_evaluate serves it in vLLM (eagle3, greedy, k = 3) on the
held-out prompts (KIND@K,K,...: at each K, through 05 --k-sweep; a block draft at most its block
minus one). KIND is `speculators` (speculators.train.cli through
eagle3_testkit.speculators_train, on the 02 store converted by eagle3_testkit.speculators_data; its
defaults otherwise: Muon lr 1e-3 linear, norm_before_fc, forward KL, TTT 3, bf16 autocast) or
`ours` (04_train with FLAGS beyond the inputs). Default arms, in this order:

    speculators   = speculators:--epochs 7 --total-seq-len 2048
    ours-shape-lr = ours:--ttt-steps 3 --max-tokens-per-batch 2048 --epochs 7 --lr 3e-3
    ours-defaults = ours:

Resumable per arm: an arm whose <results>/<name>/arm.json exists is reported, not rerun (delete
that directory to redo it); a half-done arm restarts its unfinished step (04 resumes from its
checkpoints). Results: <results>/results.json and results.md (configuration, training wall,
validation AL from 04's own validation, vLLM AL, and each ratio to the speculators arm).
Run it alone on the machine: training wall is the figure compared.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import time
from pathlib import Path

from eagle3_testkit.bench_runs import BENCH_TARGET, made_data, run_stage
from eagle3_train.common.config import EVALUATE as EVAL_STAGE
from eagle3_train.common.config import TRAIN as TRAIN_STAGE
from eagle3_train.common.errors import PipelineError, run_main
from eagle3_train.common.manifest import is_complete as complete
from eagle3_train.common.store import atomic_write_text

DEFAULT_ARMS = {
    "speculators": "speculators:--epochs 7 --total-seq-len 2048",
    "ours-shape-lr": "ours:--ttt-steps 3 --max-tokens-per-batch 2048 --epochs 7 --lr 3e-3",
    "ours-defaults": "ours:",
}
K = 3  # the speculators arm's own validation counts TTT 3; 04's is read at each arm's first K


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", type=Path, default=Path("/work/bench"),
                   help="scripts/bench/data.py's output (default: /work/bench)")
    p.add_argument("--results", type=Path, default=None, help="(default: <root>/results)")
    p.add_argument("--target", type=Path, default=BENCH_TARGET, help=f"(default: {BENCH_TARGET})")
    p.add_argument("--arm", action="append", default=[], metavar="NAME=KIND:FLAGS",
                   help="an arm (repeatable; replaces the defaults): KIND speculators or ours, "
                        "KIND@3,7 to serve it at K = 3 and 7 (default: K = 3)")
    p.add_argument("--only", default=None, help="comma-separated arm names to run, in this order (default: all)")
    p.add_argument("--num-prompts", type=int, default=100, help="held-out prompts served (default: 100)")
    p.add_argument("--concurrency", type=int, default=16, help="05's requests in flight (default: 16)")
    p.add_argument("--max-tokens", type=int, default=400, help="05's max tokens per answer (default: 400)")
    p.add_argument("--val-fraction", type=float, default=0.05,
                   help="held-out share for speculators' validation rows, 04's default rule (default: 0.05)")
    p.add_argument("--server-arg", action="append", default=[],
                   help="extra `vllm serve` argument for 05's servers, repeatable, e.g. --server-arg=--dtype=bfloat16 "
                        "--server-arg=--attention-backend=AMX_MLA for an MLA draft on a DeepSeek-V3-style target "
                        "(default: none)")
    return p.parse_args(argv)


def parse_arms(specs: list[str]) -> dict[str, tuple[str, list[str], list[int]]]:
    """NAME=KIND[@K,K]:FLAGS -> {NAME: (KIND, FLAGS, [K, ...])}."""
    arms = {}
    for spec in specs or [f"{k}={v}" for k, v in DEFAULT_ARMS.items()]:
        name, sep, rest = spec.partition("=")
        kind, sep2, flags = rest.partition(":")
        kind, _, ks = kind.partition("@")
        try:
            k_list = [int(k) for k in ks.split(",")] if ks else [K]
        except ValueError:
            k_list = []
        if not (sep and sep2) or kind not in ("speculators", "ours") or not name or not k_list \
                or min(k_list) < 1:
            raise PipelineError(f"--arm {spec!r}: expected NAME=speculators:FLAGS or NAME=ours[@K,K]:FLAGS")
        arms[name] = (kind, shlex.split(flags), k_list)
    return arms


def train_speculators(arm_dir: Path, d: dict, target: Path, flags: list[str], val_fraction: float) -> Path:
    """speculators' CLI (its Trainer) on the converted store; the last epoch's checkpoint is the draft."""
    import subprocess

    from eagle3_testkit.speculators_data import convert_store, write_vocab_npy

    conv = d["root"] / "speculators-data"
    info = convert_store(d["hidden"], conv, val_fraction=val_fraction)
    d2t, t2d = write_vocab_npy(d["vocab"], conv)
    ckpt = arm_dir / "checkpoints"
    cmd = [sys.executable, "-m", "eagle3_testkit.speculators_train", "--verifier-name-or-path", str(target),
           "--data-path", str(conv), "--save-path", str(ckpt), "--log-dir", str(arm_dir / "logs"),
           "--target-layer-ids", *map(str, info["layer_ids"][:-1]), "--d2t-path", str(d2t), "--t2d-path", str(t2d),
           "--train-data-ratio", str(info["train_data_ratio"]), "--on-missing", "raise",
           # CPU: no Triton for the fused loss, no FlexAttention backward; one process for the data.
           "--loss-implementation", "eager", "--draft-attn-impl", "sdpa", "--num-workers", "0", *flags]
    with open(arm_dir / "train.log", "a") as f:
        f.write(f"$ {shlex.join(cmd)}\n")
        f.flush()
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT)
    if rc:
        raise PipelineError(f"speculators training exited with {rc}; see {arm_dir / 'train.log'}")
    epochs = sorted(int(p.name) for p in ckpt.iterdir() if p.is_dir() and p.name.isdigit())
    if not epochs:
        raise PipelineError(f"speculators wrote no epoch checkpoint under {ckpt}")
    # Only what vLLM loads (config + weights): the optimizer state stays with the checkpoint.
    export = arm_dir / "export"
    tmp = arm_dir / ".tmp-export"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy2(ckpt / str(epochs[-1]) / name, tmp / name)
    shutil.rmtree(export, ignore_errors=True)
    tmp.rename(export)
    return export


def train_ours(arm_dir: Path, d: dict, target: Path, flags: list[str]) -> Path:
    run_stage("04_train.py", ["--hidden-states", d["hidden"], "--vocab-mapping", d["vocab"], "--target", target,
                              "--output-dir", arm_dir / "run", *flags], arm_dir / "train.log")
    return arm_dir / "run" / "export"


def val_al(arm_dir: Path, k: int = K) -> dict:
    """Validation acceptance length at k = 3, last and best: 04's own (vLLM's count); for the
    speculators arm its own per-epoch validation, 1 + sum over TTT steps of full_acc (the share of
    positions whose first s+1 draft tokens are all right)."""
    from eagle3_train.train.metrics import read_metrics

    ckpt = arm_dir / "checkpoints"
    if ckpt.exists():
        series = []
        for epoch in sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit()):
            path = ckpt / str(epoch) / "val_metrics.json"
            if path.exists():
                m = json.loads(path.read_text())
                series.append(1 + sum(m.get(f"full_acc_{s}_epoch", 0.0) for s in range(K)))
        return {"val_al_last": series[-1], "val_al_best": max(series)} if series else {}
    if not (arm_dir / "run").exists():
        return {}
    val = read_metrics(arm_dir / "run").get("val", [])

    def at_k(r):
        by_depth = r.get("al_by_depth")
        return by_depth[k - 1] if by_depth and len(by_depth) >= k else r.get("acceptance_length")

    series = [at_k(r) for r in val if at_k(r) is not None]
    return {"val_al_last": series[-1], "val_al_best": max(series)} if series else {}


def served(rep: dict, ks: list[int]) -> dict:
    """vLLM's AL, drafts and per-position rates at each K from 05's report."""
    if len(ks) > 1:
        return {r["k"]: {"al": r["acceptance_length"], "per_position": r["per_position_rate"]}
                for r in rep["k_sweep"]["by_k"]}
    spec = rep["online"]["arms"]["eagle3"].get("spec") or {}
    return {ks[0]: {"al": spec.get("acceptance_length"), "drafts": spec.get("drafts"),
                    "per_position": spec.get("per_position_rate")}}


def run_arm(name: str, kind: str, flags: list[str], ks: list[int], d: dict, results: Path, args) -> dict:
    arm_dir = results / name
    done = arm_dir / "arm.json"
    if done.exists():
        return json.loads(done.read_text())
    arm_dir.mkdir(parents=True, exist_ok=True)
    state_path = arm_dir / "train_done.json"
    if state_path.exists():
        state = json.loads(state_path.read_text())
    else:
        print(f"[bench] {name}: training ({kind} {shlex.join(flags)}), log {arm_dir / 'train.log'}", flush=True)
        t0 = time.monotonic()
        if kind == "speculators":
            export = train_speculators(arm_dir, d, args.target.resolve(), flags, args.val_fraction)
        else:
            export = train_ours(arm_dir, d, args.target.resolve(), flags)
        state = {"export": str(export), "train_wall_s": round(time.monotonic() - t0, 1)}
        atomic_write_text(state_path, json.dumps(state) + "\n")
    ev = arm_dir / "05"
    if not complete(ev, EVAL_STAGE):
        print(f"[bench] {name}: serving the draft in vLLM (k = {ks}, {args.num_prompts} held-out prompts)", flush=True)
        sweep = ["--k-sweep", ",".join(map(str, ks))] if len(ks) > 1 else []
        run_stage("05_evaluate.py", ["--draft", state["export"], "--target", args.target.resolve(), "--output-dir", ev,
                                     "--prompts", d["heldout"], "--num-prompts", args.num_prompts,
                                     "--num-speculative-tokens", ks[0], *sweep, "--arms", "eagle3",
                                     "--concurrency", args.concurrency, "--max-tokens", args.max_tokens,
                                     "--temperature", 0, "--max-model-len", 1024,
                                     *[f"--server-arg={a}" for a in args.server_arg]], arm_dir / "eval.log")
    rep = json.loads((ev / "report.json").read_text())
    by_k = served(rep, ks)
    out = {"name": name, "kind": kind, "flags": shlex.join(flags), "ks": ks, **state, **val_al(arm_dir, ks[0]),
           "vllm_al": by_k[ks[0]]["al"], "vllm_drafts": by_k[ks[0]].get("drafts"),
           "vllm_by_k": {str(k): v for k, v in by_k.items()}}
    if kind == "ours" and complete(arm_dir / "run", TRAIN_STAGE):
        man = json.loads((arm_dir / "run" / "manifest.json").read_text())
        out["steps"] = (man.get("counts") or {}).get("steps")
        out["resolved"] = {k: man["config"].get(k) for k in ("epochs", "ttt_steps", "max_tokens_per_batch",
                                                              "schedule", "warmup_steps") if k in man["config"]}
        out["resolved"]["lr"] = (man.get("recipe") or {}).get("lr", man["config"].get("lr"))  # as chosen
    atomic_write_text(done, json.dumps(out, indent=2) + "\n")
    return out


def table(rows: list[dict]) -> str:
    ref = next((r for r in rows if r["kind"] == "speculators"), None)

    def ratio(r, key):
        return f"{r[key] / ref[key]:.2f}" if ref and r.get(key) and ref.get(key) else "–"

    def fmt(x, spec):
        return format(x, spec) if isinstance(x, (int, float)) else "–"

    def at(r, k):
        v = (r.get("vllm_by_k") or {}).get(str(k)) or ({"al": r.get("vllm_al")} if k == K else {})
        return fmt(v.get("al"), ".3f")

    lines = ["| arm | configuration | steps | training wall (s) | val AL (own validation, last / best) "
             "| vLLM AL k = 3 | vLLM AL k = 7 | wall / speculators | vLLM AL / speculators |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cfg = f"{r['kind']} {r['flags']}".strip()
        lines.append(f"| {r['name']} | `{cfg}` | {fmt(r.get('steps'), 'd')} | {fmt(r.get('train_wall_s'), '.0f')} | "
                     f"{fmt(r.get('val_al_last'), '.2f')} / {fmt(r.get('val_al_best'), '.2f')} | "
                     f"{at(r, 3)} | {at(r, 7)} | {ratio(r, 'train_wall_s')} | {ratio(r, 'vllm_al')} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    d = made_data(args.root)
    results = args.results or d["root"] / "results"
    arms = parse_arms(args.arm)
    names = args.only.split(",") if args.only else list(arms)
    unknown = [n for n in names if n not in arms]
    if unknown:
        raise PipelineError(f"--only names unknown arms {unknown}; known: {list(arms)}")
    rows = []
    for name in names:
        kind, flags, ks = arms[name]
        rows.append(run_arm(name, kind, flags, ks, d, results, args))
        md = table(rows)
        summary = {"root": str(d["root"]), "data": json.loads(d["summary"].read_text()) if d["summary"].exists()
                   else None, "k": K, "num_prompts": args.num_prompts, "arms": rows}
        atomic_write_text(results / "results.json", json.dumps(summary, indent=2) + "\n")
        atomic_write_text(results / "results.md", md)
        print(md, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
