"""00: plan a run before anything runs: per stage the disk, the per-GPU memory (04 at its batch,
02's top-k head, 05's offline head), the tokens and the hours from tok/s rates (measured where
marked, else assumed; --rate-02 etc. override), and 01b's model: the answers its servers' KV cache
holds, the level --concurrency auto reaches and its tok/s (the pilot's measured gen_rates.json in
place of the assumptions: --measured or --work-dir). Writes nothing.

    uv run eagle3-train/00_plan.py --target docs/kimi-k2.5-text-config.json --samples 100000 \\
        --tokens-per-sample 10000 --gpus 8 --gpu-memory-gb 96 --weights-gb 554
    uv run eagle3-train/00_plan.py --target MODEL_DIR --data work/tokenized --storage fp8-topk --json
"""

from __future__ import annotations

import argparse
import sys

from eagle3_train.common.errors import run_main
from eagle3_train.common.formats import ATTNS, DRAFT_ARCHS, STORAGES, TARGET_LAYERS
from eagle3_train.plan.config import KV_DTYPES, RATED_STAGES, PlanConfig


def parse_args(argv=None) -> PlanConfig:
    C = PlanConfig
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    io = p.add_argument_group("the run")
    io.add_argument("--target", **C.arg("target"))
    io.add_argument("--data", **C.arg("data"))
    io.add_argument("--samples", type=int, **C.arg("samples"))
    io.add_argument("--tokens-per-sample", type=float, **C.arg("tokens_per_sample"))
    io.add_argument("--work-dir", **C.arg("work_dir"))
    io.add_argument("--json", action="store_true", **C.arg("json"))

    st = p.add_argument_group("the stages' settings")
    st.add_argument("--storage", choices=STORAGES, **C.arg("storage"))
    st.add_argument("--topk", type=int, **C.arg("topk"))
    st.add_argument("--n-aux", type=int, **C.arg("n_aux"))
    st.add_argument("--draft-vocab-size", type=int, **C.arg("draft_vocab_size"))
    st.add_argument("--max-tokens-per-batch", type=int, **C.arg("max_tokens_per_batch"))
    st.add_argument("--ttt-steps", type=int, **C.arg("ttt_steps"))
    st.add_argument("--epochs", type=int, **C.arg("epochs"))
    st.add_argument("--draft-arch", choices=DRAFT_ARCHS, **C.arg("draft_arch"))
    st.add_argument("--draft-layers", type=int, **C.arg("draft_layers"))
    st.add_argument("--target-layers", choices=TARGET_LAYERS, **C.arg("target_layers"))
    st.add_argument("--num-speculative-tokens", type=int, **C.arg("num_speculative_tokens"))
    st.add_argument("--block-size", type=int, **C.arg("block_size"))
    st.add_argument("--attn", choices=ATTNS, **C.arg("attn"))
    st.add_argument("--train-embeddings", action="store_true", **C.arg("train_embeddings"))
    st.add_argument("--train-lm-head", action="store_true", **C.arg("train_lm_head"))
    st.add_argument("--gen-prompt-tokens", type=int, **C.arg("gen_prompt_tokens"))
    st.add_argument("--gen-max-tokens", type=int, **C.arg("gen_max_tokens"))

    hw = p.add_argument_group("hardware and rates")
    hw.add_argument("--gpus", type=int, **C.arg("gpus"))
    hw.add_argument("--gpu-memory-gb", type=float, **C.arg("gpu_memory_gb"))
    hw.add_argument("--gpu-memory-utilization", type=float, **C.arg("gpu_memory_utilization"))
    hw.add_argument("--weights-gb", type=float, **C.arg("weights_gb"))
    hw.add_argument("--gen-servers", type=int, **C.arg("gen_servers"))
    hw.add_argument("--kv-cache-dtype", choices=KV_DTYPES, **C.arg("kv_cache_dtype"))
    hw.add_argument("--decode-context-parallel-size", type=int, **C.arg("decode_context_parallel_size"))
    hw.add_argument("--measured", **C.arg("measured"))
    for stage in RATED_STAGES:
        hw.add_argument(f"--rate-{stage}", type=float, **C.arg(f"rate_{stage}"))
    return C.from_args(p.parse_args(argv))


def main(argv=None) -> int:
    config = parse_args(argv)
    from eagle3_train.plan.stage import run

    return run(config)


def entry() -> None:
    """The numbered script's and the console script's entry: user mistakes are one `error:` line, exit 2."""
    sys.exit(run_main(main))


if __name__ == "__main__":
    entry()
