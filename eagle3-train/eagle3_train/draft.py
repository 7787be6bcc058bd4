"""The EAGLE-3 draft, built on speculators 0.9.0's `Eagle3DraftModel` / `Eagle3SpeculatorConfig`.

- `layer_config` / `build_draft`: a one-layer Llama-style (or Qwen3-style) draft for a target, with
  the vocab mapping, `eagle_aux_hidden_state_layer_ids` and `target_hidden_size` set explicitly.
- `TargetHead`: the target's final norm + lm_head, frozen, that turns a stored last hidden state
  into the target's next-token logits over the draft vocab (and its greedy token over the full one).
- `unroll`: the training-time-test unroll over a packed batch, yielding each step's logits so the
  caller owns the loss (forward KL from hidden states or from stored top-k) and the metrics.
  It runs the model's own modules and mask helpers in the same order as speculators' forward,
  which returns only a loss computed from its own verifier head (tests check both agree).
- `export_draft`: the speculators-format directory vLLM serves (`method: eagle3`).

Where speculators 0.9.0 stops: its `fc` is sized `n_aux * draft_hidden` and its verifier loading
refuses a target whose hidden size differs from the draft's. A draft narrower than the target
therefore gets `fc` rebuilt to `n_aux * target_hidden -> draft_hidden` (what vLLM's Eagle3 Llama
builds from `target_hidden_size`) and its own trainable `embed_tokens`, which the export carries.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn

from .errors import PipelineError
from .manifest import text_config
from .store import TMP_PREFIX, atomic_dir_commit

ARCHS = ("llama", "qwen3", "mla")  # mla: draft_mla.py (DeepSeek-V3 / Kimi targets)


# ----------------------------------------------------------------------------- target weights

def load_target_weights(target: str | Path) -> dict[str, torch.Tensor]:
    """embed_tokens, lm_head (tied -> embed) and the final norm of a target checkpoint, read
    tensor by tensor from its safetensors shards (a 1T target is never loaded whole)."""
    from speculators.utils.loading import load_model_layers

    from .target_layout import load_config, text_weight_names

    names = text_weight_names(load_config(target))
    with contextlib.suppress(ImportError):  # speculators logs one INFO line per file read
        from loguru import logger

        logger.disable("speculators.utils.loading")
    try:
        w = load_model_layers(list(names.values()), str(target))
    except (FileNotFoundError, ValueError) as e:
        raise PipelineError(f"cannot read embed/lm_head/norm weights from --target {target}: {e}") from None
    if names["embed"] not in w:
        raise PipelineError(f"--target {target} has no embed_tokens weight ({names['embed']})")
    if names["norm"] not in w:
        raise PipelineError(f"--target {target} has no final norm weight ({names['norm']})")
    return {"embed": w[names["embed"]], "lm_head": w.get(names["lm_head"], w[names["embed"]]), "norm": w[names["norm"]]}


class TargetHead(nn.Module):
    """The target's final RMSNorm + lm_head, frozen. `draft_logits` gives the target's logits over
    the draft vocabulary (the training target); `greedy` its argmax over the full vocabulary
    (the token vLLM would compare a draft against)."""

    def __init__(self, norm: torch.Tensor, lm_head: torch.Tensor, eps: float,
                 draft_ids: torch.Tensor | None, gemma_norm: bool = False):
        super().__init__()
        self.eps = float(eps)
        self.gemma_norm = gemma_norm  # Gemma/Qwen3.5 scale by (1 + w)
        self.register_buffer("norm", norm.detach().clone(), persistent=False)
        self.register_buffer("full", lm_head.detach().clone(), persistent=False)
        rows = self.full if draft_ids is None else self.full[draft_ids].clone()
        self.register_buffer("rows", rows, persistent=False)

    def normed(self, last: torch.Tensor) -> torch.Tensor:
        x = last.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        w = self.norm.float() + 1.0 if self.gemma_norm else self.norm.float()
        return (w * x).to(self.rows.dtype)

    @torch.no_grad()
    def draft_logits(self, last: torch.Tensor) -> torch.Tensor:
        return self.normed(last) @ self.rows.T

    @torch.no_grad()
    def greedy(self, last: torch.Tensor, chunk: int = 2048, normed: torch.Tensor | None = None) -> torch.Tensor:
        x = self.normed(last) if normed is None else normed
        return torch.cat([(x[i: i + chunk] @ self.full.T).argmax(-1) for i in range(0, x.shape[0], chunk)]) \
            if x.shape[0] else torch.zeros(0, dtype=torch.long, device=x.device)

    @torch.no_grad()
    def targets(self, last: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits over the draft vocab, greedy token over the full vocab), one normalisation."""
        x = self.normed(last)
        return x @ self.rows.T, self.greedy(last, normed=x)


def target_head(target_cfg, weights: dict, draft_ids: torch.Tensor | None, device, dtype) -> TargetHead:
    from speculators.models.utils import GEMMA_STYLE_FINAL_NORM_MODEL_TYPES

    tc = text_config(target_cfg)
    gemma = str(getattr(tc, "model_type", "")).lower() in GEMMA_STYLE_FINAL_NORM_MODEL_TYPES
    return TargetHead(weights["norm"], weights["lm_head"], getattr(tc, "rms_norm_eps", 1e-6),
                      draft_ids, gemma).to(device=device, dtype=dtype)


# ----------------------------------------------------------------------------- the draft

def resolve_arch(arch: str, target_cfg, mla_dims: dict | None = None) -> str:
    """`auto` -> mla for a target with multi-head latent attention (DeepSeek-V3 / Kimi; measured
    better there, README "04"), else llama. MLA dims asked for a non-MLA draft are refused."""
    from .target import has_mla

    if arch == "auto":
        arch = "mla" if has_mla(text_config(target_cfg)) else "llama"
    if arch != "mla" and (asked := [f"--draft-{k.replace('_', '-')}" for k, v in (mla_dims or {}).items()
                                    if v is not None]):
        raise PipelineError(f"{', '.join(asked)} shape an MLA draft layer, but this draft is {arch} "
                            f"(the target has no MLA config, or --draft-arch {arch})")
    return arch


def layer_config(target_cfg, *, arch: str = "llama", hidden_size: int | None = None,
                 intermediate_size: int | None = None, num_layers: int = 1, num_heads: int | None = None,
                 num_kv_heads: int | None = None, head_dim: int | None = None, attn_impl: str = "sdpa"):
    """The draft decoder's config, shaped from the target: same width, heads and rope unless told
    otherwise; vocab = the target's (d2t/t2d restrict it)."""
    from transformers import LlamaConfig
    from transformers.models.qwen3.configuration_qwen3 import Qwen3Config

    if arch not in ARCHS:
        raise PipelineError(f"--draft-arch must be one of {ARCHS}, not {arch!r}")
    tc = text_config(target_cfg)
    same_width = hidden_size in (None, tc.hidden_size)
    hidden = int(hidden_size or tc.hidden_size)
    heads = num_heads or (tc.num_attention_heads if same_width and hidden % tc.num_attention_heads == 0
                          else max(1, hidden // 128))
    if head_dim is None:
        head_dim = hidden // heads
    kv = num_kv_heads or getattr(tc, "num_key_value_heads", None) if same_width else num_kv_heads
    if not kv or heads % kv:
        kv = heads
    if intermediate_size is None:
        base = getattr(tc, "intermediate_size", None)
        intermediate_size = int(base * hidden / tc.hidden_size) if base else 3 * hidden
    rope = getattr(tc, "rope_parameters", None)
    theta = (rope or {}).get("rope_theta", getattr(tc, "rope_theta", 10000.0)) if isinstance(rope, dict) \
        else getattr(tc, "rope_theta", 10000.0)
    # Llama/Qwen3 targets: the same rope. Others (DeepSeek-V3's YaRN with mscale) have no exact
    # Llama equivalent in vLLM, so the draft uses plain rope with the target's theta.
    if tc.model_type in ("llama", "qwen3", "qwen2", "mistral") and isinstance(rope, dict):
        rope = {k: v for k, v in rope.items() if k not in ("type", "partial_rotary_factor", "mrope_section")}
    else:
        rope = {"rope_type": "default", "rope_theta": float(theta)}
    common = dict(vocab_size=tc.vocab_size, hidden_size=hidden, intermediate_size=int(intermediate_size),
                  num_hidden_layers=num_layers, num_attention_heads=heads, num_key_value_heads=kv,
                  head_dim=head_dim, hidden_act=getattr(tc, "hidden_act", "silu"),
                  max_position_embeddings=getattr(tc, "max_position_embeddings", 4096),
                  rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-6), tie_word_embeddings=False,
                  attention_bias=False, pad_token_id=None, rope_parameters=rope)
    if arch == "llama":
        cfg = LlamaConfig(**common, mlp_bias=False)
    else:
        cfg = Qwen3Config(**common, use_sliding_window=False, layer_types=["full_attention"] * num_layers)
    cfg._attn_implementation = attn_impl
    return cfg


def use_compiled_flex() -> None:
    """Make speculators' flex attention run compiled (uncompiled flex materialises the full
    score matrix). speculators compiles its whole forward on CUDA; our unroll compiles the kernel.
    Called only when training on CUDA with flex attention."""
    import speculators.models.attention as sa

    if not getattr(sa, "_eagle3_train_compiled", False):
        # One kernel per TTT step (the key length grows) and per grad mode: more than dynamo's
        # default of 8 recompiles, after which it would silently fall back to the slow path.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        sa.flex_attention = torch.compile(sa.flex_attention, dynamic=False)
        sa._eagle3_train_compiled = True


def copy_target_rows(model, weights: dict | None, t2d) -> bool:
    """The target's embed_tokens and its lm_head rows for the draft vocab into `model`; False
    (nothing copied) without target weights."""
    if weights is None:
        return False
    with torch.no_grad():
        model.embed_tokens.weight.copy_(weights["embed"].float())
        head = weights["lm_head"].float()
        model.lm_head.weight.copy_(head[t2d.bool()] if model.use_draft_vocab else head)
    return True


def build_draft(target: str, target_cfg, *, aux_layer_ids: list[int], d2t: torch.Tensor | None,
                t2d: torch.Tensor | None, weights: dict | None, arch: str = "llama",
                hidden_size: int | None = None, intermediate_size: int | None = None, num_layers: int = 1,
                num_heads: int | None = None, num_kv_heads: int | None = None,
                norm_before_residual: bool = False, norm_before_fc: bool = False, norm_output: bool = False,
                speculative_tokens: int = 3,
                train_embeddings: bool = False, train_lm_head: bool = False, attn_impl: str = "sdpa",
                init_std: float = 0.02, seed: int = 0, mla_dims: dict | None = None):
    """A fresh draft for `target`. `weights` (from load_target_weights) seed embed_tokens and
    lm_head when the draft is as wide as the target; a narrower draft learns its own."""
    if arch == "mla":
        from .draft_mla import build_mla_draft

        return build_mla_draft(target, target_cfg, aux_layer_ids=aux_layer_ids, d2t=d2t, t2d=t2d, weights=weights,
                               hidden_size=hidden_size, intermediate_size=intermediate_size, num_layers=num_layers,
                               num_heads=num_heads, dims=mla_dims, norm_before_residual=norm_before_residual,
                               fc_norm=norm_before_fc, norm_output=norm_output,
                               speculative_tokens=speculative_tokens, train_embeddings=train_embeddings,
                               train_lm_head=train_lm_head, attn_impl=attn_impl, init_std=init_std, seed=seed)
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    tc = text_config(target_cfg)
    lc = layer_config(target_cfg, arch=arch, hidden_size=hidden_size, intermediate_size=intermediate_size,
                      num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads,
                      attn_impl=attn_impl)
    vocab = tc.vocab_size
    draft_vocab = vocab if d2t is None else int(d2t.shape[0])
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=lc, draft_vocab_size=draft_vocab,
        norm_before_residual=norm_before_residual, norm_before_fc=norm_before_fc, norm_output=norm_output,
        target_hidden_size=tc.hidden_size,
        eagle_aux_hidden_state_layer_ids=list(aux_layer_ids), embed_requires_grad=train_embeddings,
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=speculative_tokens)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=str(target),
                                    architectures=list(getattr(target_cfg, "architectures", None) or [])),
        ),
    )
    torch.manual_seed(seed)
    model = Eagle3DraftModel(config)
    n_aux = len(aux_layer_ids)
    wide = lc.hidden_size == tc.hidden_size
    if not wide:
        model.fc = nn.Linear(n_aux * tc.hidden_size, lc.hidden_size, bias=False)
        nn.init.normal_(model.fc.weight, std=init_std)
        if model.input_norm is not None:  # speculators sizes it by the draft's width too; vLLM by fc's input
            model.input_norm = type(model.input_norm)(n_aux * tc.hidden_size, eps=lc.rms_norm_eps)
    if d2t is not None and draft_vocab != vocab:
        model.load_vocab_mappings(t2d.bool(), d2t.long())
    if not copy_target_rows(model, weights if wide else None, t2d):
        with torch.no_grad():
            nn.init.normal_(model.embed_tokens.weight, std=init_std)
            nn.init.normal_(model.lm_head.weight, std=init_std)
        train_embeddings = train_lm_head = True
    # The training targets come from our own TargetHead; the model's copies are never used.
    model.verifier_lm_head = None
    model.verifier_norm = None
    model.embed_tokens.weight.requires_grad_(train_embeddings)
    model.lm_head.weight.requires_grad_(train_lm_head)
    model.config.embed_requires_grad = train_embeddings
    return model


def draft_to_target(model) -> Callable[[torch.Tensor], torch.Tensor]:
    """Maps draft-vocab ids to target-vocab ids (target = draft + d2t[draft])."""
    if not model.use_draft_vocab:
        return lambda d: d
    d2t = model.d2t
    return lambda d: d + d2t[d]


# ----------------------------------------------------------------------------- the unroll

def dense_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """speculators' step-0 mask as a dense bool [1, 1, S, S] (causal within a document, padding
    attends only to itself), built directly instead of through vmap over its mask_mod, which
    costs ~10% of a CPU step. Equality with speculators' is tested."""
    pos = torch.arange(doc_ids.shape[0], device=doc_ids.device)
    keep = (doc_ids[:, None] == doc_ids[None, :]) & (doc_ids[:, None] != -1) & (pos[:, None] >= pos[None, :])
    return (keep | (pos[:, None] == pos[None, :]))[None, None]


def head(model, state: torch.Tensor) -> torch.Tensor:
    """Draft logits from what `unroll(..., states=True)` yields (any subset of its rows)."""
    return model.lm_head(state if model.config.norm_output else model.norm(state))


def unroll(model, aux: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor,
           doc_ids: torch.Tensor, steps: int, *, states: bool = False) -> Iterator[torch.Tensor]:
    """Training-time test over a packed batch: yields the logits [1, S, draft_vocab] of steps
    0..steps-1 (with `states`, the head's input [1, S, H] instead, so a caller can apply the head
    to the rows it needs only). Step k at packed position j predicts token j+k+1 of the (shifted)
    input; its input is the ground-truth token (teacher forcing) and the draft's own hidden state
    of step k-1, and it attends to the step-0 context of its document plus its own earlier steps."""
    from speculators.models.eagle3.attention import (extend_dense_mask_for_draft_tokens,
                                                     extend_mask_for_draft_tokens)
    from transformers import DynamicCache

    total = aux.shape[1]
    device = aux.device
    cache = DynamicCache()
    mask = dense_mask(doc_ids) if model._attn_impl == "sdpa" else model._build_attn_mask(doc_ids, total, device)
    flex = model._attn_impl == "simple_flex_attention"
    hidden = aux
    if model.input_norm is not None:
        hidden = model.input_norm(hidden)
    if model.fc_norm is not None:
        hidden = torch.cat([n(c) for n, c in zip(model.fc_norm, hidden.chunk(len(model.fc_norm), -1))], -1)
    hidden = model.fc(hidden)
    ids = input_ids
    for k in range(steps):
        with torch.set_grad_enabled(torch.is_grad_enabled() and model.embed_tokens.weight.requires_grad):
            embeds = model.embed_tokens(ids)
        hidden = torch.cat([embeds, hidden], dim=-1)
        rope = model.rotary_emb(hidden, position_ids)
        cache_position = torch.arange(k * total, (k + 1) * total, dtype=torch.long, device=device)
        for layer in model.layers:
            hidden = layer(hidden, attention_mask=mask, position_ids=position_ids, past_key_values=cache,
                           cache_position=cache_position, position_embeddings=rope)
        if model.config.norm_output:
            hidden = model.norm(hidden)
        yield hidden if states else head(model, hidden)
        if k + 1 == steps:
            break
        ids = torch.cat([input_ids[:, 1 + k:], input_ids.new_zeros(1, 1 + k)], dim=-1)
        mask = extend_mask_for_draft_tokens(mask) if flex else extend_dense_mask_for_draft_tokens(mask, total)
        position_ids = position_ids + 1


# ----------------------------------------------------------------------------- export

def export_draft(model, out_dir: Path, *, extra: dict | None = None) -> Path:
    """Write the speculators-format directory (config.json + model.safetensors) atomically and
    check what vLLM relies on is in it (an MLA draft: vLLM's deepseek_eagle3 format, draft_mla.py)."""
    from safetensors import safe_open

    if getattr(model, "is_mla", False):
        from .draft_mla import export_mla

        return export_mla(model, out_dir, extra=extra)

    out_dir = Path(out_dir)
    tmp = out_dir.parent / f"{TMP_PREFIX}{out_dir.name}"
    if tmp.exists():
        import shutil

        shutil.rmtree(tmp)
    model.save_pretrained(str(tmp), safe_serialization=True)
    cfg = json.loads((tmp / "config.json").read_text())
    want = {"speculators_model_type": "eagle3",
            "eagle_aux_hidden_state_layer_ids": list(model.config.eagle_aux_hidden_state_layer_ids),
            "draft_vocab_size": model.config.draft_vocab_size,
            "target_hidden_size": model.config.target_hidden_size,
            "norm_before_residual": model.config.norm_before_residual,
            "norm_before_fc": model.config.norm_before_fc, "norm_output": model.config.norm_output}
    for key, val in want.items():
        if cfg.get(key) != val:
            raise RuntimeError(f"export config.json has {key}={cfg.get(key)!r}, expected {val!r}")
    with safe_open(str(tmp / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    need = {"fc.weight", "norm.weight", "lm_head.weight", "embed_tokens.weight"}
    if model.config.norm_before_fc:
        need.add("input_norm.weight")
    if model.use_draft_vocab:
        need |= {"d2t", "t2d"}
    if missing := need - keys:
        raise RuntimeError(f"export weights lack {sorted(missing)}")
    if extra:
        (tmp / "training_info.json").write_text(json.dumps(extra, indent=2, sort_keys=True, default=str) + "\n")
    atomic_dir_commit(tmp, out_dir)
    return out_dir


def lr_lambda(step: int, *, warmup: int, total: int, schedule: str, min_ratio: float) -> float:
    """Linear warmup, then cosine / linear decay to min_ratio (constant: stays at 1)."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant" or total <= warmup:
        return 1.0
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    decay = 0.5 * (1 + math.cos(math.pi * frac)) if schedule == "cosine" else 1 - frac
    return min_ratio + (1 - min_ratio) * decay
