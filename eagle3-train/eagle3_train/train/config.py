"""04's settings: one typed config, built once from the arguments, validated here and nowhere else,
saved in run.json and the manifest. Fields marked `may_change` may differ when a run is resumed
(they do not change its trajectory); any other difference is a different run."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from ..errors import PipelineError

STAGE = "04_train"


def may_change(default):
    """A field a resumed run may set differently from the run it resumes."""
    return field(default=default, metadata={"may_change": True})


@dataclass(frozen=True)
class TrainConfig:
    # -- inputs (directories may move between a run and its resumption: their manifests'
    #    hashes are what identify them, see inputs.input_identity)
    hidden_states: str = may_change("")
    """02's output directory (shards + manifest)."""
    vocab_mapping: str = may_change("")
    """03's output directory (vocab_mapping.safetensors + manifest)."""
    target: str = ""
    """Target model path or name: its config, final norm, lm_head and embeddings."""

    # -- output
    output_dir: str = may_change("")
    """The run directory: run.json, checkpoints/, metrics.jsonl, export/, manifest.json."""
    overwrite: bool = may_change(False)
    """Move a run made with other settings aside (to replaced-<time>/) instead of refusing."""
    export_from: str = may_change("best")
    """Export the checkpoint with the best validation acceptance ("best") or the last ("last")."""

    # -- the draft
    draft_arch: str = "llama"
    """Decoder layer style: llama or qwen3."""
    draft_layers: int = 1
    """Decoder layers."""
    draft_hidden_size: int | None = None
    """Draft width (None: the target's); narrower than the target trains its own embeddings."""
    draft_intermediate_size: int | None = None
    """MLP width (None: the target's intermediate_size scaled to the draft width)."""
    draft_heads: int | None = None
    """Attention heads (None: the target's)."""
    draft_kv_heads: int | None = None
    """Key/value heads (None: the target's)."""
    aux_layer_ids: list[int] | None = None
    """Aux layers the draft reads, a subset of the store's (None: all of them)."""
    norm_before_residual: bool = False
    """Normalise the fused hidden state before the residual."""
    train_embeddings: bool = False
    """Train embed_tokens too (default: a frozen copy of the target's)."""
    train_lm_head: bool = False
    """Train the draft lm_head too (default: frozen, the target's rows for the draft vocab)."""
    num_speculative_tokens: int = 3
    """Speculative tokens written into the export's config."""

    # -- objective
    ttt_steps: int = 7
    """Training-time-test steps: how many chained draft tokens the loss unrolls."""
    ttt_decay: str = "1.0"
    """Per-step loss weights: g (step k weighs g**k) or a comma list of ttt_steps numbers."""

    # -- optimisation
    lr: float = 1e-4
    """Peak learning rate."""
    min_lr_ratio: float = 0.0
    """Final lr / peak lr."""
    schedule: str = "cosine"
    """Decay after warmup: cosine, linear or constant."""
    warmup_steps: int | None = None
    """Warmup steps (None: warmup_ratio of all steps)."""
    warmup_ratio: float = 0.02
    """Warmup share of all steps, when warmup_steps is None."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    grad_clip: float = 0.5
    """Gradient norm clip; 0 = off."""

    # -- data
    max_tokens_per_batch: int = 4096
    """Tokens per packed batch per process; longer samples are cut to it."""
    grad_accum: int = 1
    """Batches per process per optimizer step."""
    epochs: int = 1
    """Passes over the training split."""
    max_steps: int | None = None
    """Stop after this many steps (None: all the epochs make)."""
    val_fraction: float = 0.05
    """Share of samples held out by id hash for validation (the split rule 03 and 05 use)."""
    val_max_samples: int | None = 500
    """Validate on at most this many held-out samples."""
    seed: int = 0
    """Initialisation and data order."""

    # -- hardware and distribution
    device: str = "auto"
    """auto (CUDA when available), cuda or cpu."""
    distributed: str = "ddp"
    """Under torchrun: replicate (ddp) or shard (fsdp) the draft."""
    attn: str = "auto"
    """Attention kernel: auto (flex on CUDA, sdpa on CPU), flex, sdpa or eager."""
    loss_impl: str = "auto"
    """KL kernel: auto (speculators' fused Triton loss on CUDA, eager on CPU), fused or eager."""
    threads: int | None = may_change(None)
    """CPU threads per process (None: torch's default)."""

    # -- checkpoints and logging
    save_every: int = may_change(500)
    """Checkpoint + validation every N steps and at the end."""
    keep_last: int = may_change(2)
    """Checkpoints kept besides the best."""
    log_every: int = may_change(10)
    """A metrics record every N steps."""
    progress_every: float = may_change(30.0)
    """Seconds between progress.log lines."""
    quiet: bool = may_change(False)
    """No progress bar."""

    def __post_init__(self):
        for name in ("ttt_steps", "max_tokens_per_batch", "grad_accum", "epochs", "save_every", "log_every",
                     "draft_layers", "num_speculative_tokens", "keep_last"):
            if getattr(self, name) < 1:
                raise PipelineError(f"--{_flag(name)} must be at least 1, not {getattr(self, name)}")
        if self.max_steps is not None and self.max_steps < 1:
            raise PipelineError(f"--max-steps must be at least 1, not {self.max_steps}")
        if not 0 <= self.val_fraction < 1:
            raise PipelineError(f"--val-fraction must be in [0, 1), not {self.val_fraction}")
        if self.lr <= 0:
            raise PipelineError(f"--lr must be positive, not {self.lr}")
        self.step_weights  # noqa: B018 -- a malformed --ttt-decay is refused before any work

    @classmethod
    def from_args(cls, args) -> TrainConfig:
        """From 04's parsed arguments (their dests are the field names)."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})

    @classmethod
    def may_change_on_resume(cls) -> set[str]:
        return {f.name for f in fields(cls) if f.metadata.get("may_change")}

    @property
    def step_weights(self) -> list[float]:
        """The TTT loss weight of each step, from ttt_decay."""
        try:
            vals = [float(x) for x in str(self.ttt_decay).split(",")]
        except ValueError:
            raise PipelineError(f"--ttt-decay must be a number or a comma list of numbers, "
                                f"not {self.ttt_decay!r}") from None
        if len(vals) == 1:
            return [vals[0] ** k for k in range(self.ttt_steps)]
        if len(vals) != self.ttt_steps:
            raise PipelineError(f"--ttt-decay lists {len(vals)} weights, but --ttt-steps is {self.ttt_steps}")
        return vals

    def kernels(self, cuda: bool) -> dict[str, str]:
        """The attention and KL kernels `auto` resolves to on this device; the ones it cannot run
        are refused."""
        attn = self.attn if self.attn != "auto" else ("flex" if cuda else "sdpa")
        if attn == "flex" and not cuda:
            raise PipelineError("--attn flex needs CUDA (flex attention has no CPU backward); use sdpa")
        loss_impl = self.loss_impl if self.loss_impl != "auto" else ("fused" if cuda else "eager")
        if loss_impl == "fused" and not cuda:
            raise PipelineError("--loss-impl fused needs CUDA (a Triton kernel); use eager")
        return {"attn": attn, "loss_impl": loss_impl}

    def record(self) -> dict:
        """As saved in run.json and the manifest: local paths made absolute."""
        cfg = asdict(self)
        for k in ("hidden_states", "vocab_mapping", "output_dir", "target"):
            if k != "target" or Path(cfg[k]).exists():
                cfg[k] = str(Path(cfg[k]).resolve())
        return cfg


def _flag(name: str) -> str:
    return name.replace("_", "-")
