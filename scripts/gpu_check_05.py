#!/usr/bin/env python3
"""GPU check for 05_evaluate (run by hand on a CUDA box with vLLM; about 2 minutes on one H200).

    uv run python scripts/gpu_check_05.py --out gpu_check_05.json [--draft runs/demo/04/export]

Serves the bundled tiny target (assets/tiny-reasoner) in vLLM on the GPU twice -- with the trained
draft (method eagle3, K = 3) and without speculation -- sends the demo's held-out prompts at
concurrency 1, 16 and 64 with the same greedy settings, and records vLLM's acceptance length,
per-position acceptance and output tokens/s of both arms, plus the speed-up (report.json of 05).
The draft is the CPU demo's export (carry runs/demo/04/export; `bash scripts/demo.sh` makes it).

Exit 0 when both arms ran, every request succeeded and vLLM accepted draft tokens (AL > 1.5, as
the CPU end-to-end test requires); 3 when vLLM is not importable here; 1 otherwise. The speed-up
is recorded, not required: a 0.5M-parameter target is launch-bound, so it says little about a 1T one.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="results JSON path")
    p.add_argument("--draft", type=Path, default=REPO / "runs" / "demo" / "04" / "export",
                   help="trained EAGLE-3 export (default: runs/demo/04/export)")
    p.add_argument("--arms", default="eagle3,none", help="(default: eagle3,none; add ngram if time allows)")
    p.add_argument("--concurrency", default="1,16,64", help="(default: 1,16,64)")
    p.add_argument("--num-prompts", type=int, default=64, help="(default: 64)")
    return p.parse_args(argv)


def probe_vllm() -> tuple[bool, str]:
    """Whether vLLM imports in the interpreter that serves it, and its version / error."""
    from eagle3_train.common.vllm_server import vllm_python

    code = "import vllm, torch; print(vllm.__version__, torch.cuda.is_available())"
    probe = subprocess.run([vllm_python(), "-c", code], capture_output=True, text=True)
    return probe.returncode == 0, probe.stdout.strip() or probe.stderr.strip()[-300:]


def check(args, work: Path) -> dict:
    """05 on the tiny target with `args.draft`, its online arms in vLLM; the report's figures."""
    from eagle3_testkit.fixtures import tiny_reasoner_dir
    from eagle3_testkit.tiny import write_prompt_file

    result = {"check": "05_evaluate on GPU", "draft": str(args.draft)}
    prompts = write_prompt_file(work / "heldout.jsonl", args.num_prompts, seed=2)
    cmd = [sys.executable, str(REPO / "eagle3-train" / "05_evaluate.py"), "--draft", str(args.draft),
           "--target", str(tiny_reasoner_dir()), "--prompts", str(prompts), "--output-dir", str(work / "eval"),
           "--arms", args.arms, "--concurrency", args.concurrency, "--num-prompts", str(args.num_prompts),
           "--max-tokens", "320", "--max-model-len", "1024", "--server-arg=--gpu-memory-utilization=0.3",
           "--server-arg=--enforce-eager"]  # eager: a CUDA-graph capture per arm would not fit 2 min
    t0 = time.perf_counter()
    rc = subprocess.call(cmd)
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    result["exit_code"] = rc
    ok = False
    if rc == 0:
        rep = json.loads((work / "eval" / "report.json").read_text())
        arms = rep["online"]["arms"]
        result["arms"] = {a: {"spec": r["spec"], "levels": [{k: lv[k] for k in ("concurrency", "output_tok_s",
                                                                              "requests", "errors")}
                                                             for lv in r["levels"]]} for a, r in arms.items()}
        result["speedup_vs_none"] = rep["online"]["speedup_vs_none"]
        al = arms.get("eagle3", {}).get("spec", {}).get("acceptance_length") or 0
        result["acceptance_length"] = al
        ok = al > 1.5 and all(lv["errors"] == 0 for r in arms.values() for lv in r["levels"])
        print((work / "eval" / "report.md").read_text())
    result["ok"] = ok
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    importable, version = probe_vllm()
    if not importable:
        args.out.write_text(json.dumps({"check": "05_evaluate on GPU", "vllm": version}, indent=2) + "\n")
        print(f"vLLM is not importable: {version}")
        return 3
    if not (args.draft / "config.json").exists():
        print(f"no draft export at {args.draft}: run `bash scripts/demo.sh` (CPU) first or pass --draft")
        return 1
    result = {"vllm": version} | check(args, Path(tempfile.mkdtemp(prefix="gpu_check_05-")))
    args.out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"gpu_check_05: {'OK' if result['ok'] else 'FAILED'} in {result['wall_s']} s -> {args.out}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
