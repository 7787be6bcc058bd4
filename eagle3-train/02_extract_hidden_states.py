#!/usr/bin/env python3
"""02: run the target over the tokenized training set and store EAGLE-3's features.

For every token: the residual stream entering the auxiliary layers (default vLLM's (2, N//2, N-3))
and the last layer's output before the final norm (or, with --storage fp8-topk, the target's
top-k next-token distribution instead), in safetensors shards with an index, a fixed plan and a
manifest. Rerunning the same command resumes; --validate checks a finished store.

  python eagle3-train/02_extract_hidden_states.py --input data/tokenized --model TARGET \
      --output data/hidden
  # several GPUs, one process each (shards are split by rank):
  torchrun --nproc-per-node 8 eagle3-train/02_extract_hidden_states.py --input ... --model ... --output ...
  # the 1T target through vLLM (prints the `vllm serve` command to start first):
  python eagle3-train/02_extract_hidden_states.py --backend vllm --input ... --model ... --output ...
"""

from __future__ import annotations

import argparse
import sys

from eagle3_train.errors import run_main
from eagle3_train.extract import run


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    io = p.add_argument_group("input / output")
    io.add_argument("--data", "--input", dest="input", required=True,
                    help="tokenized training set directory (data.jsonl + manifest)")
    io.add_argument("--output-dir", "--output", dest="output", required=True,
                    help="store directory (shards, index, plan, manifest)")
    io.add_argument("--overwrite", action="store_true",
                    help="move an existing output into replaced-<time>/ and start over (default: resume)")

    tg = p.add_argument_group("target")
    tg.add_argument("--model", required=True, help="target model directory or name")
    tg.add_argument("--tokenizer", default=None,
                    help="tokenizer to check the input against (default: the target's)")
    tg.add_argument("--backend", choices=("hf", "vllm"), default="hf",
                    help="hf: transformers on CPU/GPU(s); vllm: a vLLM server with extract_hidden_states "
                         "(needs a GPU) (default: hf)")
    tg.add_argument("--layers", default=None,
                    help="auxiliary layer ids, comma-separated; id i = input of layer i "
                         "(default: vLLM's 2,N//2,N-3)")
    tg.add_argument("--dtype", choices=("auto", "bfloat16", "float16", "float32"), default="auto",
                    help="compute dtype of the hf target (default: auto = bfloat16 on GPU, float32 on CPU)")
    tg.add_argument("--device", default="auto",
                    help="hf device: auto, cpu, cuda, cuda:1 ... (default: auto = cuda:LOCAL_RANK if any)")
    tg.add_argument("--device-map", default=None,
                    help="hf device_map for a target larger than one GPU, e.g. auto (default: none)")

    st = p.add_argument_group("storage")
    st.add_argument("--storage", default="bf16", choices=("bf16", "fp16", "fp32", "fp8", "fp8-topk"),
                    help="bf16/fp16/fp32: aux + last as is; fp8: e4m3 with a scale per token and layer "
                         "(~50%% of bf16); fp8-topk: fp8 aux + the target's top-k next-token "
                         "log-probs instead of the last hidden state (~38%% at Kimi-K2.5 size) (default: bf16)")
    st.add_argument("--topk", type=int, default=32, help="k for --storage fp8-topk (default: 32)")
    st.add_argument("--shard-mb", type=float, default=1024,
                    help="target shard size in MB (fixed in plan.json at the first run) (default: 1024)")

    bt = p.add_argument_group("batching and parallelism")
    bt.add_argument("--batch-tokens", type=int, default=16384,
                    help="hf: max batch size x longest sample per forward (default: 16384)")
    bt.add_argument("--max-batch-size", type=int, default=64, help="hf: max samples per forward (default: 64)")
    bt.add_argument("--rank", type=int, default=None, help="this process's rank (default: $RANK or 0)")
    bt.add_argument("--world-size", type=int, default=None,
                    help="number of processes splitting the shards (default: $WORLD_SIZE or 1)")

    vl = p.add_argument_group("vllm backend")
    vl.add_argument("--server-url", default=None,
                    help="base URL of a running server started with the printed command, e.g. "
                         "http://127.0.0.1:8000/v1 (default: none: print the command and exit)")
    vl.add_argument("--launch-server", action="store_true",
                    help="start the vLLM server here for the duration of the run (default: no)")
    vl.add_argument("--hidden-states-dir", default=None,
                    help="where the server's connector writes per-request files "
                         "(default: OUTPUT/.vllm-requests)")
    vl.add_argument("--concurrency", type=int, default=32, help="requests in flight (default: 32)")
    vl.add_argument("--tensor-parallel-size", type=int, default=1,
                    help="for the printed/launched server (default: 1)")
    vl.add_argument("--max-model-len", type=int, default=None,
                    help="for the printed/launched server (default: longest sample + 1)")
    vl.add_argument("--request-timeout", type=float, default=600, help="seconds per request (default: 600)")
    vl.add_argument("--served-model-name", default=None,
                    help="model name the server answers to (default: --model)")
    vl.add_argument("--vllm-args", default="",
                    help="more flags for the printed/launched server, one string, e.g. "
                         "'--gpu-memory-utilization 0.85 --enforce-eager' (default: none)")

    ck = p.add_argument_group("checks")
    ck.add_argument("--force", action="store_true", help="start even if the disk estimate says it will not fit")
    ck.add_argument("--validate", action="store_true",
                    help="only re-read every shard: shapes, token ids vs the input, NaN/inf (exit 2 if bad)")
    ck.add_argument("--repair", action="store_true",
                    help="validate this rank's shards, move bad ones aside, then redo them")
    args = p.parse_args(argv)
    if args.topk < 1:
        p.error("--topk must be at least 1")
    if args.shard_mb <= 0 or args.batch_tokens < 1 or args.max_batch_size < 1 or args.concurrency < 1:
        p.error("--shard-mb, --batch-tokens, --max-batch-size and --concurrency must be positive")
    return args


def main(argv=None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(run_main(main))
