"""How 04's best learning rate moves with the draft's width (issue 13: a default lr that works from the
tiny targets up to Kimi-K2.5's hidden 7168), measured on a width ladder.

Each rung is one target and its 02 store: the benchmark target itself and the same target lifted to a
wider residual stream without changing what it computes (eagle3_testkit.widen; build the rungs with
`scripts/build_targets.py wide`), so every rung poses the same problem and only the draft's width
differs. The draft keeps the proportions of the base target's own draft at every width (MLP width
over hidden, head size, query heads per key/value head), as a real wider target's draft would. Each
point is 04 itself, as its own process, for a fixed number of steps; lrs are multiples of 04's
default for that width (budget.default_lr), so a rule that transfers puts every rung's best at the
same multiple (the best lr: eagle3_testkit.bench_runs.best_lr).

    uv run python scripts/bench/sweep_lr_width.py --vocab-mapping /work/bench/03 --out /work/sweep-bench \\
        --rung 256=assets/bench-reasoner:/work/bench/02 \\
        --rung 512=/work/wide/target-512:/work/wide/02-512:/work/wide/03-512 --multipliers 0.5,1,2 --jobs 2

Writes sweep.json (every point) and sweep.png (validation AL against lr, one curve per width), and
prints the table and, per width, the best lr of a parabola through log(lr) -> AL around the best point.
A point already run (its 04 manifest exists) is read back, so the command resumes.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from eagle3_testkit.bench_runs import STAGES, best_lr
from eagle3_train.common.errors import PipelineError, run_main
from eagle3_train.common.manifest import is_complete
from eagle3_train.common.store import atomic_write_text
from eagle3_train.train.budget import LR_WIDTH_EXPONENT, default_lr


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rung", action="append", required=True, metavar="WIDTH=TARGET:STORE[:VOCAB]",
                   help="a width, its target, its 02 store and its 03 output (default: --vocab-mapping); "
                        "repeatable")
    p.add_argument("--vocab-mapping", default=None, help="03 output of a rung that names none")
    p.add_argument("--out", type=Path, required=True, help="one 04 run directory per point under it")
    p.add_argument("--multipliers", default="0.5,1,2", help="lrs as multiples of the width's default "
                                                            "(default: 0.5,1,2)")
    p.add_argument("--lrs", default="", help="absolute lrs run at every width besides (default: none)")
    p.add_argument("--steps", type=int, default=150, help="optimizer steps per point (default: 150)")
    p.add_argument("--max-tokens-per-batch", type=int, default=2048, help="(default: 2048)")
    p.add_argument("--val-max-samples", type=int, default=200, help="(default: 200)")
    p.add_argument("--jobs", type=int, default=1, help="points run at once, one thread each (default: 1)")
    p.add_argument("--extra", default="", help="more 04 flags for every point, one string (default: none)")
    p.add_argument("--report-only", action="store_true", help="run nothing: the table and plot from the points "
                                                              "already in --out")
    return p.parse_args(argv)


def parse_rung(text: str, vocab: str | None) -> dict:
    try:
        width, rest = text.split("=", 1)
        target, store, *more = rest.split(":")
        if len(more) > 1 or not (more or vocab):
            raise ValueError
        return {"width": int(width), "target": target, "store": store, "vocab": more[0] if more else vocab}
    except ValueError:
        raise PipelineError(f"--rung {text!r}: expected WIDTH=TARGET:STORE:VOCAB (or :STORE with "
                            f"--vocab-mapping)") from None


def shape_flags(target: str, width: int) -> list[str]:
    """The draft's shape at `width` in the proportions of the draft 04 gives the unwidened target
    (MLP width / hidden, head size, query heads per key/value head)."""
    cfg = json.loads((Path(target) / "config.json").read_text())
    base = cfg.get("widened_from", {}).get("hidden_size", cfg["hidden_size"])
    head_dim = base // cfg["num_attention_heads"]
    heads = max(1, width // head_dim)
    group = cfg["num_attention_heads"] // cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    return ["--draft-intermediate-size", str(cfg["intermediate_size"] * width // base), "--draft-heads", str(heads),
            "--draft-kv-heads", str(max(1, heads // group))]


def points(a) -> list[dict]:
    out = []
    for rung in (parse_rung(r, a.vocab_mapping) for r in a.rung):
        lrs = {float(f"{default_lr(rung['width']) * float(m):.3g}") for m in a.multipliers.split(",") if m}
        lrs |= {float(x) for x in a.lrs.split(",") if x}
        out += [{**rung, "lr": lr, "multiplier": lr / default_lr(rung["width"])} for lr in sorted(lrs)]
    return out


def point_dir(a, pt: dict) -> Path:
    return a.out / f"w{pt['width']}-lr{pt['lr']:g}"


def run_point(a, pt: dict) -> dict:
    out = point_dir(a, pt)
    if not is_complete(out, "04_train"):
        cmd = [sys.executable, str(STAGES / "04_train.py"), "--hidden-states", pt["store"],
               "--vocab-mapping", pt["vocab"], "--target", pt["target"], "--output-dir", str(out),
               "--lr", str(pt["lr"]), "--budget", str(a.steps), "--max-tokens-per-batch", str(a.max_tokens_per_batch),
               "--save-every", str(a.steps), "--log-every", "10", "--val-max-samples", str(a.val_max_samples),
               "--threads", "1", "--quiet", *shape_flags(pt["target"], pt["width"]), *a.extra.split()]
        t0 = time.monotonic()
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            return {**pt, "error": ((r.stderr or r.stdout).strip().splitlines() or ["?"])[-1][-300:]}
        atomic_write_text(out / "wall.json", json.dumps({"wall_s": round(time.monotonic() - t0)}) + "\n")
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    train = [x for x in recs if x.get("kind") == "train"]
    val = [x for x in recs if x.get("kind") == "val"]
    wall = json.loads((out / "wall.json").read_text())["wall_s"] if (out / "wall.json").exists() else None
    return {**pt, "loss_first": train[0]["loss"], "loss_last": train[-1]["loss"],
            "val_al": val[-1]["acceptance_length"], "val_loss": val[-1]["loss"],
            "wall_s": wall}


def plot(rows: list[dict], path: Path) -> None:
    """Validation AL against the lr (left) and against the lr over the width's default (right): a
    rule that transfers lines the right-hand peaks up."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for w in sorted({r["width"] for r in rows}):
        pts = sorted((r["lr"], r["val_al"]) for r in rows if r["width"] == w and "val_al" in r)
        if not pts:
            continue
        lrs, als = zip(*pts, strict=True)
        line = axes[0].plot(lrs, als, marker="o", label=f"width {w}")[0]
        axes[1].plot([x / default_lr(w) for x in lrs], als, marker="o", color=line.get_color(), label=f"width {w}")
    axes[0].set_xlabel("peak lr")
    axes[1].set_xlabel("peak lr / 04's default for the width")
    axes[0].set_ylabel("validation acceptance length")
    for ax in axes:
        ax.set_xscale("log")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    a = parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    todo = points(a)
    if a.report_only:
        todo = [pt for pt in todo if is_complete(point_dir(a, pt), "04_train")]
    with ThreadPoolExecutor(max(1, a.jobs)) as pool:
        rows = list(pool.map(lambda pt: run_point(a, pt), todo))
    atomic_write_text(a.out / "sweep.json", json.dumps(rows, indent=2) + "\n")
    print("| width | lr | x default | train loss first -> last | val loss | val AL | wall (s) |\n"
          "|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['width']} | {r['lr']:g} | {r['multiplier']:.2f} | error: {r['error']} | | | |")
        else:
            print(f"| {r['width']} | {r['lr']:g} | {r['multiplier']:.2f} | {r['loss_first']:.3f} -> "
                  f"{r['loss_last']:.3f} | {r['val_loss']:.3f} | {r['val_al']:.3f} | {r['wall_s'] or '-'} |")
    best = {}
    for w in sorted({r["width"] for r in rows}):
        b = best_lr([r for r in rows if r["width"] == w])
        if b:
            best[w] = b
        print(f"width {w}: default lr {default_lr(w):.3g}; best lr "
              + (f"{b:.3g} ({b / default_lr(w):.2f}x the default)" if b else "at an edge of the grid"))
    if len(best) >= 2:
        k = -statistics.linear_regression([math.log(w) for w in best], [math.log(b) for b in best.values()]).slope
        print(f"best lr ~ width^-{k:.2f} over widths {', '.join(map(str, best))} "
              f"(04's default: width^-{LR_WIDTH_EXPONENT:g})")
    plot([r for r in rows if "val_al" in r], a.out / "sweep.png")
    print(f"wrote {a.out / 'sweep.json'}, {a.out / 'sweep.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
