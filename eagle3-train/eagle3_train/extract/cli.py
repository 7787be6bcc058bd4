"""02: run the target over the tokenized training set and store EAGLE-3's features.

For every token: the residual stream entering the auxiliary layers (default vLLM's (2, N//2, N-3))
and the last layer's output before the final norm (or, with --storage fp8-topk, the target's
top-k next-token distribution instead), in safetensors shards with an index, a fixed plan and a
manifest. Rerunning the same command resumes; --validate checks a finished store.

  uv run eagle3-train/02_extract_hidden_states.py --input data/tokenized --model TARGET \\
      --output-dir data/hidden
  # several GPUs, one process each (shards are split by rank):
  uv run torchrun --nproc-per-node 8 eagle3-train/02_extract_hidden_states.py --input ... --model ... --output-dir ...
  # the 1T target through vLLM (prints the `vllm serve` command to start first):
  uv run eagle3-train/02_extract_hidden_states.py --backend vllm --input ... --model ... --output-dir ...
"""

from __future__ import annotations

import argparse
import signal
import sys

from eagle3_train.common.config import join_dash_values
from eagle3_train.common.errors import run_main
from eagle3_train.common.server_wait import wait_seconds
from eagle3_train.extract.config import BACKENDS, DTYPES, STORAGES, ExtractConfig


def parse_args(argv=None) -> ExtractConfig:
    C = ExtractConfig
    argv = join_dash_values(sys.argv[1:] if argv is None else argv, ("--layers",))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    io = p.add_argument_group("input / output")
    io.add_argument("--input", "--data", **C.arg("input"))
    io.add_argument("--output-dir", "--output", **C.arg("output_dir"))
    io.add_argument("--overwrite", action="store_true", **C.arg("overwrite"))
    io.add_argument("--progress-every", type=float, **C.arg("progress_every"))

    tg = p.add_argument_group("target")
    tg.add_argument("--model", **C.arg("model"))
    tg.add_argument("--tokenizer", **C.arg("tokenizer"))
    tg.add_argument("--backend", choices=BACKENDS, **C.arg("backend"))
    tg.add_argument("--layers", **C.arg("layers"))
    tg.add_argument("--dtype", choices=DTYPES, **C.arg("dtype"))
    tg.add_argument("--device", **C.arg("device"))
    tg.add_argument("--device-map", **C.arg("device_map"))

    st = p.add_argument_group("storage")
    st.add_argument("--storage", choices=STORAGES, **C.arg("storage"))
    st.add_argument("--topk", type=int, **C.arg("topk"))
    st.add_argument("--shard-mb", type=float, **C.arg("shard_mb"))
    st.add_argument("--max-store-gb", type=float, **C.arg("max_store_gb"))
    st.add_argument("--stop-when-full", action="store_true", **C.arg("stop_when_full"))

    bt = p.add_argument_group("batching and parallelism")
    bt.add_argument("--batch-tokens", type=int, **C.arg("batch_tokens"))
    bt.add_argument("--max-batch-size", type=int, **C.arg("max_batch_size"))
    bt.add_argument("--rank", type=int, **C.arg("rank"))
    bt.add_argument("--world-size", type=int, **C.arg("world_size"))

    vl = p.add_argument_group("vllm backend")
    vl.add_argument("--server-url", **C.arg("server_url"))
    vl.add_argument("--launch-server", action="store_true", **C.arg("launch_server"))
    vl.add_argument("--hidden-states-dir", **C.arg("hidden_states_dir"))
    vl.add_argument("--concurrency", type=int, **C.arg("concurrency"))
    vl.add_argument("--tensor-parallel-size", type=int, **C.arg("tensor_parallel_size"))
    vl.add_argument("--max-num-batched-tokens", type=int, **C.arg("max_num_batched_tokens"))
    vl.add_argument("--max-model-len", type=int, **C.arg("max_model_len"))
    vl.add_argument("--request-timeout", type=float, **C.arg("request_timeout"))
    vl.add_argument("--startup-timeout", type=float, **C.arg("startup_timeout"))
    vl.add_argument("--wait-for-server", type=wait_seconds, **C.arg("wait_for_server"))
    vl.add_argument("--served-model-name", **C.arg("served_model_name"))
    vl.add_argument("--vllm-args", **C.arg("vllm_args"))

    ck = p.add_argument_group("checks")
    ck.add_argument("--force", action="store_true", **C.arg("force"))
    ck.add_argument("--validate", action="store_true", **C.arg("validate_only"))
    ck.add_argument("--repair", action="store_true", **C.arg("repair"))
    ck.add_argument("--dry-run", action="store_true", **C.arg("dry_run"))
    return C.from_args(p.parse_args(argv))


def main(argv=None) -> int:
    config = parse_args(argv)
    if config.dry_run:
        from eagle3_train.common.dry_run import dry_run  # 00's figures, reached without importing 00

        return dry_run(config)
    from eagle3_train.extract import run

    return run(config)


def _interrupt(signum, frame):
    raise KeyboardInterrupt  # SIGTERM stops like Ctrl-C: a server launched here is stopped (and waited for)


def entry() -> None:
    """The numbered script's and the console script's entry: user mistakes are one `error:` line, exit 2."""
    signal.signal(signal.SIGTERM, _interrupt)
    sys.exit(run_main(main))


if __name__ == "__main__":
    entry()
