#!/usr/bin/env python3
"""04: train the EAGLE-3 draft on 02's hidden states and 03's vocab mapping, and export it in the
speculators format vLLM serves (`--speculative-config '{"method": "eagle3", "model": OUT/export}'`).

    python eagle3-train/04_train.py --hidden-states work/hidden --vocab-mapping work/vocab \\
        --target MODEL --output-dir work/draft
    torchrun --nproc-per-node 8 eagle3-train/04_train.py ...            # DDP on 8 GPUs
    torchrun --nnodes 2 --node-rank R --master-addr HOST --nproc-per-node 8 eagle3-train/04_train.py ...

Rerunning the same command resumes from the last complete checkpoint.
"""

from __future__ import annotations

import argparse
import sys

from eagle3_train.errors import run_main


def _ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer ids, got {text!r}") from None


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("inputs")
    g.add_argument("--hidden-states", required=True, help="02 output directory (shards + manifest)")
    g.add_argument("--vocab-mapping", required=True, help="03 output directory (vocab_mapping.safetensors)")
    g.add_argument("--target", required=True,
                   help="target model path or name: config, final norm, lm_head and embeddings")
    g = p.add_argument_group("output")
    g.add_argument("--output-dir", "--out", dest="output_dir", required=True,
                   help="run directory (checkpoints, metrics, export/)")
    g.add_argument("--overwrite", action="store_true",
                   help="move a run made with other settings aside (to replaced-<time>/) and start over "
                        "(default: refuse)")
    g.add_argument("--export-from", choices=("best", "last"), default="best",
                   help="export the checkpoint with the best validation acceptance, or the last (default: best)")
    g = p.add_argument_group("draft model")
    g.add_argument("--draft-arch", choices=("llama", "qwen3"), default="llama",
                   help="decoder layer style (default: llama)")
    g.add_argument("--draft-layers", type=int, default=1, help="decoder layers (default: 1)")
    g.add_argument("--draft-hidden-size", type=int, default=None,
                   help="draft width; smaller than the target's trains its own embeddings (default: target's)")
    g.add_argument("--draft-intermediate-size", type=int, default=None,
                   help="MLP width (default: target's intermediate_size scaled to the draft width)")
    g.add_argument("--draft-heads", type=int, default=None, help="attention heads (default: target's)")
    g.add_argument("--draft-kv-heads", type=int, default=None, help="key/value heads (default: target's)")
    g.add_argument("--aux-layer-ids", type=_ids, default=None,
                   help="aux layers the draft reads, a subset of the store's (default: all of them)")
    g.add_argument("--norm-before-residual", action="store_true",
                   help="normalise the fused hidden state before the residual (default: off, as speculators)")
    g.add_argument("--train-embeddings", action="store_true",
                   help="train embed_tokens too (default: frozen copy of the target's)")
    g.add_argument("--train-lm-head", action="store_true",
                   help="train the draft lm_head too (default: frozen, the target's rows for the draft vocab)")
    g.add_argument("--num-speculative-tokens", type=int, default=3,
                   help="speculative tokens written into the export's config (default: 3)")
    g = p.add_argument_group("objective")
    g.add_argument("--ttt-steps", type=int, default=7, help="training-time-test steps (default: 7)")
    g.add_argument("--ttt-decay", default="1.0",
                   help="per-step loss weights: g (step k weighs g**k) or a comma list (default: 1.0)")
    g = p.add_argument_group("optimisation")
    g.add_argument("--lr", type=float, default=1e-4, help="peak learning rate (default: 1e-4)")
    g.add_argument("--min-lr-ratio", type=float, default=0.0, help="final lr / peak lr (default: 0)")
    g.add_argument("--schedule", choices=("cosine", "linear", "constant"), default="cosine",
                   help="decay after warmup (default: cosine)")
    g.add_argument("--warmup-steps", type=int, default=None, help="warmup steps (default: --warmup-ratio)")
    g.add_argument("--warmup-ratio", type=float, default=0.02, help="warmup share of all steps (default: 0.02)")
    g.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay (default: 0.01)")
    g.add_argument("--beta1", type=float, default=0.9, help="AdamW beta1 (default: 0.9)")
    g.add_argument("--beta2", type=float, default=0.95, help="AdamW beta2 (default: 0.95)")
    g.add_argument("--grad-clip", type=float, default=0.5, help="gradient norm clip, 0 = off (default: 0.5)")
    g = p.add_argument_group("data")
    g.add_argument("--max-tokens-per-batch", type=int, default=4096,
                   help="tokens per packed batch per process; longer samples are cut (default: 4096)")
    g.add_argument("--grad-accum", type=int, default=1, help="batches per process per step (default: 1)")
    g.add_argument("--epochs", type=int, default=1, help="passes over the training split (default: 1)")
    g.add_argument("--max-steps", type=int, default=None, help="stop after this many steps (default: all)")
    g.add_argument("--val-fraction", type=float, default=0.05,
                   help="share of samples held out by id hash for validation (default: 0.05)")
    g.add_argument("--val-max-samples", type=int, default=500,
                   help="validate on at most this many held-out samples (default: 500)")
    g.add_argument("--seed", type=int, default=0, help="initialisation and data order (default: 0)")
    g = p.add_argument_group("hardware and distribution")
    g.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="auto = CUDA when available (default: auto)")
    g.add_argument("--distributed", choices=("ddp", "fsdp"), default="ddp",
                   help="under torchrun: replicate (ddp) or shard (fsdp) the draft (default: ddp)")
    g.add_argument("--attn", choices=("auto", "flex", "sdpa", "eager"), default="auto",
                   help="attention kernel: auto = flex on CUDA, sdpa on CPU (default: auto)")
    g.add_argument("--loss-impl", choices=("auto", "fused", "eager"), default="auto",
                   help="KL kernel: auto = speculators' fused Triton loss on CUDA, eager on CPU (default: auto)")
    g.add_argument("--threads", type=int, default=None, help="CPU threads per process (default: torch's)")
    g = p.add_argument_group("checkpoints and logging")
    g.add_argument("--save-every", type=int, default=500,
                   help="checkpoint + validation every N steps and at the end (default: 500)")
    g.add_argument("--keep-last", type=int, default=2,
                   help="checkpoints kept besides the best (default: 2)")
    g.add_argument("--log-every", type=int, default=10, help="metrics record every N steps (default: 10)")
    g.add_argument("--progress-every", type=float, default=30.0,
                   help="seconds between progress.log lines (default: 30)")
    g.add_argument("--quiet", action="store_true", help="no progress bar (default: off)")
    return p.parse_args(argv)


def config(argv=None):
    """The arguments as 04's TrainConfig (validated: a bad value is one error line)."""
    from eagle3_train.train import TrainConfig

    return TrainConfig.from_args(parse_args(argv))


def main(argv=None) -> int:
    from eagle3_train.train import run

    run(config(argv))
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
