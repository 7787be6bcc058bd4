"""What 02's compact storage costs in draft quality, on the tiny trained target.

  uv run python scripts/bench/extract_quality.py [--samples 400] [--steps 300] [--storages bf16 fp8 fp8-topk]

One tokenized set (the synthetic reasoning task the target was trained on, tokenized with its
tokenizer) -> 02 once per storage option -> 03 once -> 04 per store (same seed, same steps, same
split) -> 05 offline acceptance of each draft on the held-out samples of the *bf16* store: when
vLLM serves the draft it hands it unquantised hidden states, so that is the fair yardstick.
Reported: acceptance length (AL = 1 + accepted / drafts) and per-position acceptance.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from eagle3_testkit.bench_runs import workdir, write_json
from eagle3_train.evaluate.cli import main as evaluate_main
from eagle3_train.extract.cli import main as extract_main
from eagle3_train.train.cli import main as train_main
from eagle3_train.vocab.cli import main as vocab_main


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=400, help="synthetic samples (default: 400)")
    p.add_argument("--steps", type=int, default=300, help="04 optimizer steps per draft (default: 300)")
    p.add_argument("--storages", nargs="+", default=["bf16", "fp8", "fp8-topk"], help="options to compare")
    p.add_argument("--topk", type=int, default=32, help="k for fp8-topk (default: 32)")
    p.add_argument("--lr", type=float, default=3e-3, help="04 peak learning rate, tiny draft (default: 3e-3)")
    p.add_argument("--k", type=int, default=3, help="speculative tokens in the offline eval (default: 3)")
    p.add_argument("--threads", type=int, default=1, help="torch threads for 04 (default: 1)")
    p.add_argument("--workdir", type=Path, default=None, help="keep everything here (default: a temp dir)")
    p.add_argument("--json", type=Path, default=None, help="also write the results here (default: no)")
    return p.parse_args(argv)


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
                      "--storage", st, "--topk", str(args.topk)])
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


def main(argv=None):
    args = parse_args(argv)
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


if __name__ == "__main__":
    main()
