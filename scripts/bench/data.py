"""The draft-quality benchmark's data (issue 13), made by the real pipeline, resumably.

    EAGLE3_VLLM_PYTHON=/work/main/.venv-vllm/bin/python \
        uv run python scripts/bench/data.py [--root /work/bench] [--prompts 2000] [--heldout 100]

  prompts  --prompts training + --heldout held-out questions of eagle3_testkit.bench_tasks (other seeds)
  01b      assets/bench-reasoner answers the training questions greedily in real vLLM, tokenized (01c)
  02       its hidden states at aux layers 1,3,4 (+ the last layer), transformers backend
  03       a 512-token draft vocabulary
Rerun the same command to resume: a stage whose manifest exists is skipped. The figures (samples,
tokens, supervised tokens) go to <root>/data.json; stage output to <root>/bench_data.log.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from eagle3_testkit.bench_runs import AUX_LAYERS, BENCH_TARGET, DRAFT_VOCAB, HELDOUT_SEED, TRAIN_SEED, layout, run_stage
from eagle3_testkit.bench_tasks import write_bench_prompts
from eagle3_train.common.errors import run_main
from eagle3_train.common.hidden_store import STAGE as STORE_STAGE
from eagle3_train.common.manifest import is_complete as complete
from eagle3_train.common.store import atomic_write_text
from eagle3_train.generate.stage import STAGE as GEN_STAGE
from eagle3_train.tokenize.dataset import STAGE as TOKENIZE_STAGE
from eagle3_train.vocab.mapping import STAGE as VOCAB_STAGE


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", type=Path, default=Path("/work/bench"), help="(default: /work/bench)")
    p.add_argument("--target", type=Path, default=BENCH_TARGET, help=f"(default: {BENCH_TARGET})")
    p.add_argument("--prompts", type=int, default=2000, help="training prompts (default: 2000)")
    p.add_argument("--heldout", type=int, default=100, help="held-out prompts for 05 (default: 100)")
    p.add_argument("--max-tokens", type=int, default=400,
                   help="01b's max tokens per answer; the longest task needs ~320 (default: 400)")
    p.add_argument("--concurrency", type=int, default=64, help="01b's requests in flight (default: 64)")
    p.add_argument("--server-arg", action="append", default=[],
                   help="extra `vllm serve` argument for 01b's server, repeatable, e.g. "
                        "--server-arg=--dtype=bfloat16 --server-arg=--attention-backend=AMX_MLA for a "
                        "DeepSeek-V3-style target served as 05 serves it with an MLA draft (default: none)")
    return p.parse_args(argv)


def data_figures(tokenized: Path) -> dict:
    n = tokens = supervised = 0
    with open(tokenized / "data.jsonl") as f:
        for line in f:
            rec = json.loads(line)
            n += 1
            tokens += len(rec["input_ids"])
            supervised += sum(rec["loss_mask"])
    return {"samples": n, "tokens": tokens, "supervised_tokens": supervised}


def main(argv=None) -> int:
    from eagle3_train.common.vllm_server import VllmServer

    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    d = layout(args.root)
    log = d["root"] / "bench_data.log"
    target = args.target.resolve()
    d["prompts"].parent.mkdir(parents=True, exist_ok=True)
    times = {}
    # Deterministic, so rewriting them changes nothing; 01b refuses a changed input file anyway.
    for path, n, seed in ((d["prompts"], args.prompts, TRAIN_SEED), (d["heldout"], args.heldout, HELDOUT_SEED)):
        write_bench_prompts(path, n, seed)
    t0 = time.monotonic()
    if not (complete(d["gen"], GEN_STAGE) and complete(d["tokenized"], TOKENIZE_STAGE)):
        with VllmServer(target, served_name="bench-reasoner", max_model_len=1024,
                        log_path=d["root"] / "vllm-01b.log", extra_args=args.server_arg) as srv:
            cmd = ["--input", d["prompts"], "--output-dir", d["gen"], "--base-url", srv.base_url,
                   "--model", "bench-reasoner", "--concurrency", args.concurrency, "--max-tokens",
                   args.max_tokens, "--temperature", 0, "--seed", 0, "--timeout", 900, "--tokenize",
                   "--tokenizer", target]
            if run_stage("01b_generate_synthetic.py", cmd, log, ok=(0, 1)) == 1:
                run_stage("01b_generate_synthetic.py", cmd, log)  # one more pass for the failed ids
        times["01b"] = time.monotonic() - t0
    t0 = time.monotonic()
    if not complete(d["hidden"], STORE_STAGE):
        run_stage("02_extract_hidden_states.py", ["--input", d["tokenized"], "--model", target, "--output-dir",
                                                  d["hidden"], "--backend", "hf", "--layers", AUX_LAYERS,
                                                  "--shard-mb", 256], log)
        times["02"] = time.monotonic() - t0
    t0 = time.monotonic()
    if not complete(d["vocab"], VOCAB_STAGE):
        run_stage("03_build_vocab_mapping.py", ["--data", d["tokenized"], "--target", target, "--output-dir",
                                                d["vocab"], "--draft-vocab-size", DRAFT_VOCAB], log)
        times["03"] = time.monotonic() - t0
    old = json.loads(d["summary"].read_text()) if d["summary"].exists() else {}
    stage_s = {**old.get("stage_s", {}), **{k: round(v) for k, v in times.items()}}
    summary = {"target": str(target), "aux_layers": AUX_LAYERS, "draft_vocab": DRAFT_VOCAB,
               "heldout_prompts": args.heldout, **data_figures(d["tokenized"]), "stage_s": stage_s}
    atomic_write_text(d["summary"], json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
