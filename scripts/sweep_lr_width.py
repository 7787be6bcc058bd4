"""A short learning-rate sweep of 04 at several draft widths on one store (issue 13: an lr that
works from the tiny targets up to hidden 7168). Each run is 04 itself, as its own process, for a
fixed number of steps; the table says whether the loss fell, diverged (non-finite or above its
start) and the validation AL at the end.

    uv run python scripts/sweep_lr_width.py --hidden-states runs/demo/02 --vocab-mapping runs/demo/03 \\
        --target assets/tiny-reasoner --out /tmp/sweep --widths 64,256,1024 --lrs 1e-3,3e-3,1e-2 \\
        --optimizers muon,adamw --steps 40
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

from eagle3_train.fixtures import REPO_ROOT


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden-states", required=True)
    p.add_argument("--vocab-mapping", required=True)
    p.add_argument("--target", required=True)
    p.add_argument("--out", type=Path, required=True, help="one 04 run directory per point under it")
    p.add_argument("--widths", default="64,256,1024", help="draft hidden sizes (default: 64,256,1024)")
    p.add_argument("--lrs", default="1e-3,3e-3,1e-2", help="peak learning rates (default: 1e-3,3e-3,1e-2)")
    p.add_argument("--optimizers", default="muon,adamw", help="(default: muon,adamw)")
    p.add_argument("--steps", type=int, default=40, help="optimizer steps per run (default: 40)")
    p.add_argument("--max-tokens-per-batch", type=int, default=512, help="(default: 512)")
    p.add_argument("--threads", type=int, default=1, help="(default: 1)")
    return p.parse_args(argv)


def point(a, width: int, lr: str, opt: str) -> dict:
    out = a.out / f"w{width}-{opt}-lr{lr}"
    cmd = [sys.executable, str(REPO_ROOT / "eagle3-train" / "04_train.py"), "--hidden-states", a.hidden_states,
           "--vocab-mapping", a.vocab_mapping, "--target", a.target, "--output-dir", str(out),
           "--draft-hidden-size", str(width), "--lr", lr, "--optimizer", opt, "--budget", str(a.steps),
           "--max-tokens-per-batch", str(a.max_tokens_per_batch), "--save-every", str(a.steps),
           "--log-every", "5", "--val-max-samples", "40", "--threads", str(a.threads), "--quiet"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        return {"width": width, "lr": lr, "optimizer": opt, "error": (r.stderr or r.stdout).strip()[-300:]}
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    train = [x for x in recs if x.get("kind") == "train"]
    val = [x for x in recs if x.get("kind") == "val"]
    first, last = train[0]["loss"], train[-1]["loss"]
    return {"width": width, "lr": lr, "optimizer": opt, "loss_first": first, "loss_last": last,
            "diverged": not math.isfinite(last) or last > first,
            "val_al": val[-1]["acceptance_length"] if val else None}


def main(argv=None) -> int:
    a = parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    rows = []
    print("| width | optimizer | lr | train loss first -> last | diverged | val AL |\n|---|---|---|---|---|---|",
          flush=True)
    for width in [int(w) for w in a.widths.split(",")]:
        for opt in a.optimizers.split(","):
            for lr in a.lrs.split(","):
                r = point(a, width, lr, opt)
                rows.append(r)
                if "error" in r:
                    print(f"| {width} | {opt} | {lr} | error: {r['error']} | | |", flush=True)
                else:
                    print(f"| {width} | {opt} | {lr} | {r['loss_first']:.3f} -> {r['loss_last']:.3f} | "
                          f"{'yes' if r['diverged'] else 'no'} | {r['val_al']:.3f} |", flush=True)
    (a.out / "sweep.json").write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
