#!/usr/bin/env python3
"""GPU check for the MLA draft (`04 --draft-arch mla`, issue 16); run by hand on a CUDA box with the
GPU vLLM (`uv sync --extra vllm`), a few minutes on one GPU.

    uv run python scripts/gpu_check_mla.py --out gpu_check_mla.json

On the trained Kimi-K2.5 twin it makes the inputs with the pipeline itself (tokenize -> 02 hf on
CUDA -> 03), then:
  fast / eager  trains the MLA draft twice on CUDA (bf16 autocast): compiled flex attention +
                speculators' fused KL, and sdpa + eager KL; the two loss trajectories must agree
                (first step within 2%, every step within 10%), as gpu_check_04 asks of the Llama head
  serve         05's eagle3 and none arms in GPU vLLM (its own MLA backend for target and draft,
                CUDA graphs on): AL from vLLM's counters > 1.2, and eagle3 makes the target's own
                tokens (within 2% of the none arm's count)
What CPU cannot show: the flex kernel on MLA's q/k width != v width, bf16 training, vLLM's GPU MLA
backends for the draft's layer. Exit 0 only if every part passes; the JSON says which failed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="results JSON path")
    p.add_argument("--samples", type=int, default=400, help="synthetic samples (default: 400)")
    p.add_argument("--max-tokens", type=int, default=4096, help="tokens per packed batch (default: 4096)")
    p.add_argument("--ttt-steps", type=int, default=3, help="TTT steps (default: 3)")
    p.add_argument("--steps", type=int, default=40, help="training steps per run (default: 40)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    result: dict = {"ok": False}
    try:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device: this check needs a GPU")
        from eagle3_testkit.fixtures import kimi_twin_dir, synthetic_training_set
        from eagle3_testkit.tiny import synthetic_examples

        target = kimi_twin_dir()
        check04 = load(REPO / "scripts" / "gpu_check_04.py", "gpu_check_04")
        result |= {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "target": str(target)}
        with tempfile.TemporaryDirectory(prefix="gpu_check_mla-") as tmp:
            work = Path(tmp)
            data = synthetic_training_set(work / "data", target, n=args.samples, seed=0)
            hs, vocab = work / "02", work / "03"
            load(REPO / "eagle3-train" / "02_extract_hidden_states.py", "s02").main(
                ["--input", str(data), "--model", str(target), "--output-dir", str(hs), "--backend", "hf"])
            load(REPO / "eagle3-train" / "03_build_vocab_mapping.py", "s03").main(
                ["--data", str(data), "--target", str(target), "--output-dir", str(vocab), "--draft-vocab-size", "256"])
            mla = ["--draft-arch", "mla", "--loss", "kl"]  # kl: the loss the fused Triton kernel computes
            result["fast"] = fast = check04.train_once(work, hs, vocab, target, args, "fast", mla)
            result["eager"] = eager = check04.train_once(work, hs, vocab, target, args, "eager",
                                                         [*mla, "--attn", "sdpa", "--loss-impl", "eager"])
            gaps = [abs(a - b) / max(abs(b), 1e-6) for a, b in zip(fast["losses"], eager["losses"])]
            finite = all(math.isfinite(x) for x in fast["losses"] + eager["losses"])
            result["train_ok"] = bool(finite and gaps[0] < 0.02 and max(gaps) < 0.10)
            result |= {"loss_rel_gap_first": gaps[0], "loss_rel_gap_max": max(gaps)}
            prompts = work / "prompts.jsonl"
            prompts.write_text("".join(json.dumps({"id": f"p{i}", "messages": [
                {"role": "user", "content": ex["question"]}, {"role": "assistant", "content": ex["answer"]}]}) + "\n"
                for i, ex in enumerate(synthetic_examples(32, 99))))
            ev = work / "05"
            load(REPO / "eagle3-train" / "05_evaluate.py", "s05").main(
                ["--draft", str(work / "fast" / "export"), "--target", str(target), "--store", str(hs),
                 "--prompts", str(prompts), "--output-dir", str(ev), "--arms", "eagle3,none",
                 "--concurrency", "8", "--max-tokens", "256", "--max-model-len", "2048"])
            rep = json.loads((ev / "report.json").read_text())
            arms = rep["online"]["arms"]
            spec = arms["eagle3"]["spec"]
            made = {a: sum(lv["completion_tokens"] for lv in arm["levels"]) for a, arm in arms.items()}
            result["serve"] = {"vllm_al": spec.get("acceptance_length"), "drafts": spec.get("drafts"),
                               "offline_al": (rep.get("offline") or {}).get("acceptance_length"), "tokens": made}
            result["serve_ok"] = bool((spec.get("acceptance_length") or 0) > 1.2
                                      and abs(made["eagle3"] - made["none"]) <= 0.02 * made["none"])
        result["ok"] = result["train_ok"] and result["serve_ok"]
    except Exception as e:  # the record says what failed, for whoever runs this remotely
        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()[-4000:]
    result["total_s"] = round(time.perf_counter() - t_start, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result.get(k) for k in ("ok", "train_ok", "serve_ok", "loss_rel_gap_max", "serve",
                                                  "total_s", "error")}, indent=2))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
