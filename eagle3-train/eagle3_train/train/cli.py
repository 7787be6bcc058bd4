"""04: train the EAGLE-3 draft on 02's hidden states and 03's vocab mapping, and export it in the format
vLLM serves (`--speculative-config '{"method": "eagle3", "model": OUT/export}'`): speculators' eagle3
format for a Llama/Qwen3 layer, vLLM's deepseek_eagle3 format (the config vLLM's DeepSeek-V3 EAGLE-3
loader reads) for the MLA layer, speculators' DFlash format for --draft-arch dflash (method dflash).

    uv run eagle3-train/04_train.py --hidden-states work/hidden --vocab-mapping work/vocab \\
        --target MODEL --output-dir work/draft
    uv run torchrun --nproc-per-node 8 eagle3-train/04_train.py ...            # DDP on 8 GPUs
    uv run torchrun --nnodes 2 --node-rank R --master-addr HOST --nproc-per-node 8 eagle3-train/04_train.py ...

Rerunning the same command resumes from the last complete checkpoint. Exit status: 0 done, 2 an
error (one `error:` line), 75 --follow stopped at --follow-timeout after checkpointing (rerun to go on).
"""

from __future__ import annotations

import argparse
import sys

from eagle3_train.common.config import join_dash_values
from eagle3_train.common.errors import run_main
from eagle3_train.common.formats import ATTNS, DRAFT_ARCHS, TARGET_LAYERS
from eagle3_train.train.config import (
    BLOCK_LOSSES,
    EXIT_FOLLOW_TIMEOUT,
    EXPORT_DTYPES,
    LOSSES,
    MLA_FIELDS,
    OPTIMIZERS,
    STAGE,
    TrainConfig,
)


def _ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer ids, got {text!r}") from None


def parse_args(argv=None) -> TrainConfig:
    """Flags, types and groups here; each default and help text comes from TrainConfig's field."""
    C = TrainConfig
    argv = join_dash_values(sys.argv[1:] if argv is None else argv, ("--aux-layer-ids", "--budget", "--ttt-decay"))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("inputs")
    g.add_argument("--hidden-states", **C.arg("hidden_states"))
    g.add_argument("--vocab-mapping", **C.arg("vocab_mapping"))
    g.add_argument("--target", **C.arg("target"))
    g = p.add_argument_group("output")
    g.add_argument("--output-dir", "--out", **C.arg("output_dir"))
    g.add_argument("--overwrite", action="store_true", **C.arg("overwrite"))
    g.add_argument("--export-from", choices=("best", "last"), **C.arg("export_from"))
    g = p.add_argument_group("draft model")
    g.add_argument("--draft-arch", choices=DRAFT_ARCHS, **C.arg("draft_arch"))
    g.add_argument("--draft-layers", type=int, **C.arg("draft_layers"))
    g.add_argument("--draft-hidden-size", type=int, **C.arg("draft_hidden_size"))
    g.add_argument("--draft-intermediate-size", type=int, **C.arg("draft_intermediate_size"))
    g.add_argument("--draft-heads", type=int, **C.arg("draft_heads"))
    g.add_argument("--draft-kv-heads", type=int, **C.arg("draft_kv_heads"))
    g.add_argument("--draft-window", metavar="N", **C.arg("draft_window"))
    for name in MLA_FIELDS:
        g.add_argument(f"--{name.replace('_', '-')}", type=int, **C.arg(name))
    g.add_argument("--aux-layer-ids", type=_ids, **C.arg("aux_layer_ids"))
    g.add_argument("--target-layers", choices=TARGET_LAYERS, **C.arg("target_layers"))
    g.add_argument("--norm-before-residual", action=argparse.BooleanOptionalAction, **C.arg("norm_before_residual"))
    g.add_argument("--norm-before-fc", action=argparse.BooleanOptionalAction, **C.arg("norm_before_fc"))
    g.add_argument("--norm-output", action=argparse.BooleanOptionalAction, **C.arg("norm_output"))
    g.add_argument("--train-embeddings", action="store_true", **C.arg("train_embeddings"))
    g.add_argument("--train-lm-head", action="store_true", **C.arg("train_lm_head"))
    g.add_argument("--num-speculative-tokens", type=int, **C.arg("num_speculative_tokens"))
    g.add_argument("--block-size", type=int, **C.arg("block_size"))
    g.add_argument("--block-anchors", type=float, metavar="N|SHARE", **C.arg("block_anchors"))
    g.add_argument("--block-causal", action=argparse.BooleanOptionalAction, **C.arg("block_causal"))
    g.add_argument("--block-loss", choices=BLOCK_LOSSES, **C.arg("block_loss"))
    g.add_argument("--block-gamma", type=float, **C.arg("block_gamma"))
    g.add_argument("--mask-token-id", type=int, **C.arg("mask_token_id"))
    g.add_argument("--export-dtype", choices=EXPORT_DTYPES, **C.arg("export_dtype"))
    g = p.add_argument_group("objective")
    g.add_argument("--ttt-steps", type=int, **C.arg("ttt_steps"))
    g.add_argument("--ttt-decay", **C.arg("ttt_decay"))
    g.add_argument("--loss", choices=LOSSES, **C.arg("loss"))
    g = p.add_argument_group("optimisation")
    g.add_argument("--optimizer", choices=OPTIMIZERS, **C.arg("optimizer"))
    g.add_argument("--lr", type=float, **C.arg("lr"))
    g.add_argument("--min-lr-ratio", type=float, **C.arg("min_lr_ratio"))
    g.add_argument("--schedule", choices=("cosine", "linear", "constant"), **C.arg("schedule"))
    g.add_argument("--warmup-steps", type=int, **C.arg("warmup_steps"))
    g.add_argument("--warmup-ratio", type=float, **C.arg("warmup_ratio"))
    g.add_argument("--weight-decay", type=float, **C.arg("weight_decay"))
    g.add_argument("--muon-weight-decay", type=float, **C.arg("muon_weight_decay"))
    g.add_argument("--beta1", type=float, **C.arg("beta1"))
    g.add_argument("--beta2", type=float, **C.arg("beta2"))
    g.add_argument("--grad-clip", type=float, **C.arg("grad_clip"))
    g = p.add_argument_group("data")
    g.add_argument("--max-tokens-per-batch", type=int, **C.arg("max_tokens_per_batch"))
    g.add_argument("--max-sample-tokens", type=int, **C.arg("max_sample_tokens"))
    g.add_argument("--window-tokens", type=int, **C.arg("window_tokens"))
    g.add_argument("--window-context", type=int, **C.arg("window_context"))
    g.add_argument("--grad-accum", type=int, **C.arg("grad_accum"))
    g.add_argument("--group-tokens", type=int, **C.arg("group_tokens"))
    g.add_argument("--epochs", type=int, **C.arg("epochs"))
    g.add_argument("--budget", **C.arg("budget"))
    g.add_argument("--max-steps", type=int, **C.arg("max_steps"))
    g.add_argument("--val-fraction", type=float, **C.arg("val_fraction"))
    g.add_argument("--val-max-samples", type=int, **C.arg("val_max_samples"))
    g.add_argument("--val-temperature", type=float, **C.arg("val_temperature"))
    g.add_argument("--seed", type=int, **C.arg("seed"))
    g.add_argument("--follow", action="store_true", **C.arg("follow"))
    g.add_argument("--consume", action="store_true", **C.arg("consume"))
    g.add_argument("--follow-timeout", type=float, **C.arg("follow_timeout"))
    g = p.add_argument_group("hardware and distribution")
    g.add_argument("--device", choices=("auto", "cuda", "cpu"), **C.arg("device"))
    g.add_argument("--distributed", choices=("ddp", "fsdp"), **C.arg("distributed"))
    g.add_argument("--attn", choices=ATTNS, **C.arg("attn"))
    g.add_argument("--loss-impl", choices=("auto", "fused", "eager"), **C.arg("loss_impl"))
    g.add_argument("--threads", type=int, **C.arg("threads"))
    g = p.add_argument_group("checkpoints and logging")
    g.add_argument("--save-every", type=int, **C.arg("save_every"))
    g.add_argument("--keep-last", type=int, **C.arg("keep_last"))
    g.add_argument("--log-every", type=int, **C.arg("log_every"))
    g.add_argument("--progress-every", type=float, **C.arg("progress_every"))
    g.add_argument("--position-buckets", metavar="N,N,...", **C.arg("position_buckets"))
    g.add_argument("--quiet", action="store_true", **C.arg("quiet"))
    g.add_argument("--dry-run", action="store_true", **C.arg("dry_run"))
    return C.from_args(p.parse_args(argv))


def main(argv=None) -> int:
    config = parse_args(argv)  # a bad setting is one error line, before torch is imported
    if config.dry_run:
        from eagle3_train.common.dry_run import dry_run  # 00's figures, reached without importing 00

        return dry_run(config)
    from eagle3_train.train import run
    from eagle3_train.train.follow import FollowTimeout

    try:
        run(config)
    except FollowTimeout as e:  # not an error: stopped, checkpointed, waiting for the producer's next shards
        print(f"{STAGE}: stopped: {e}", file=sys.stderr)
        return EXIT_FOLLOW_TIMEOUT
    return 0


def entry() -> None:
    """The numbered script's and the console script's entry: user mistakes are one `error:` line, exit 2."""
    sys.exit(run_main(main))


if __name__ == "__main__":
    entry()
