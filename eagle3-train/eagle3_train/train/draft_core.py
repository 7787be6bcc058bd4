"""What every draft layer shares (draft.py's Llama/Qwen3 drafts and draft_mla.py's MLA draft):
the target's embed/lm_head/norm weights and its frozen head, and the training-time-test unroll.

- `TargetHead`: the target's final norm + lm_head, frozen, that turns a stored last hidden state
  into the target's next-token logits over the draft vocab (and its greedy token over the full one).
- `unroll`: the training-time-test unroll over a packed batch, yielding each step's logits so the
  caller owns the loss (forward KL from hidden states or from stored top-k) and the metrics.
  It runs the model's own modules and mask helpers in the same order as speculators' forward,
  which returns only a loss computed from its own verifier head (tests check both agree).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn

from eagle3_train.common.errors import PipelineError
from eagle3_train.common.manifest import text_config


def load_target_weights(target: str | Path) -> dict[str, torch.Tensor]:
    """embed_tokens, lm_head (tied -> embed) and the final norm of a target checkpoint, read
    tensor by tensor from its safetensors shards (a 1T target is never loaded whole)."""
    from speculators.utils.loading import load_model_layers

    from eagle3_train.common.target import local_model_dir
    from eagle3_train.common.target_layout import load_config, text_weight_names

    target = local_model_dir(target, what="--target")  # a hub id: its local copy, never a download
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


def use_compiled_flex(options: dict | None = None) -> None:
    """Make speculators' flex attention run compiled (uncompiled flex materialises the full
    score matrix). speculators compiles its whole forward on CUDA; our unroll compiles the kernel.
    `options`: the kernel_options every call passes (flex.kernel_options: blocks that fit this GPU's
    shared memory; None: torch's defaults). Called only when training on CUDA with flex attention;
    calling it again swaps the options, keeping the one compiled function."""
    import speculators.models.attention as sa

    compiled = getattr(sa, "_eagle3_train_compiled", None)
    if compiled is None:
        # One kernel per TTT step (the key length grows), per grad mode and per options: more than
        # dynamo's default of 8 recompiles, after which it would silently fall back to the slow path.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        compiled = sa._eagle3_train_compiled = torch.compile(sa.flex_attention, dynamic=False)
    # speculators' flex_attention_forward looks `flex_attention` up in its module at each call
    sa.flex_attention = functools.partial(compiled, kernel_options=dict(options)) if options else compiled


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


def rows_from_target(model, weights: dict | None, t2d, init_std: float) -> bool:
    """The target's embed/lm_head rows into `model` (copy_target_rows); without them (a narrower
    draft) both are drawn fresh. True when fresh: the caller then trains them."""
    if copy_target_rows(model, weights, t2d):
        return False
    with torch.no_grad():
        nn.init.normal_(model.embed_tokens.weight, std=init_std)
        nn.init.normal_(model.lm_head.weight, std=init_std)
    return True


def draft_to_target(model) -> Callable[[torch.Tensor], torch.Tensor]:
    """Maps draft-vocab ids to target-vocab ids (target = draft + d2t[draft])."""
    if not model.use_draft_vocab:
        return lambda d: d
    d2t = model.d2t
    return lambda d: d + d2t[d]


def dense_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """speculators' step-0 mask as a dense bool [1, 1, S, S] (causal within a document, padding
    attends only to itself), built directly instead of through vmap over its mask_mod, which
    costs ~10% of a CPU step. Equality with speculators' is tested."""
    pos = torch.arange(doc_ids.shape[0], device=doc_ids.device)
    keep = (doc_ids[:, None] == doc_ids[None, :]) & (doc_ids[:, None] != -1) & (pos[:, None] >= pos[None, :])
    return (keep | (pos[:, None] == pos[None, :]))[None, None]


def window_of(model) -> int | None:
    """The draft's attention window (keys a query sees, vLLM's `sliding_window`), None: full attention.
    speculators reads it from the layer config's `layer_types` / `sliding_window` (draft.layer_config)."""
    return getattr(model, "sliding_window", None) if getattr(model, "sliding_window_indices", None) else None


def window_mask_mod(doc_ids: torch.Tensor, position_ids: torch.Tensor, window: int, step: int) -> Callable:
    """The mask of TTT step `step` (0-based) under a window, as a flex mask_mod over the step's keys
    [step-0 context | the drafts of steps 1..step]: what vLLM's sliding window lets the draft see.
    vLLM runs draft step k of a drafting position p as a query at position p + k over the cache, in
    which positions <= p hold the context (step 0) and p + 1..p + k the earlier drafts; its backends
    (flash-attn's window (N - 1, 0), the CPU kernel) keep the keys at positions q - N + 1..q of a query
    at q. So step k keeps the context keys with p - pos < N - k and the draft of step m while k - m < N;
    speculators' own windowed mask keeps the step-0 window at every step, k positions wider than vLLM's."""
    total = doc_ids.shape[0]
    pos = position_ids.reshape(-1)

    def mod(_b, _h, q, kv):
        i, m = kv % total, kv // total
        context = (m == 0) & (doc_ids[q] == doc_ids[i]) & (doc_ids[q] != -1) & (q >= i) \
            & (pos[q] + step - pos[i] < window)
        return context | ((i == q) & (step - m < window))  # padding attends only to itself, as speculators'
    return mod


def window_dense_mask(doc_ids: torch.Tensor, position_ids: torch.Tensor, window: int, step: int) -> torch.Tensor:
    """window_mask_mod's mask as a dense bool [1, 1, S, (step + 1) * S], built directly (tested equal)."""
    pos = position_ids.reshape(-1)
    idx = torch.arange(doc_ids.shape[0], device=doc_ids.device)
    eye = idx[:, None] == idx[None, :]
    context = (doc_ids[:, None] == doc_ids[None, :]) & (doc_ids[:, None] != -1) & (idx[:, None] >= idx[None, :]) \
        & (pos[:, None] + step - pos[None, :] < window)
    blocks = [context | (eye & (step < window))] + [eye & (step - m < window) for m in range(1, step + 1)]
    return torch.cat(blocks, -1)[None, None]


def window_mask(model, doc_ids: torch.Tensor, position_ids: torch.Tensor, window: int, step: int):
    """The windowed mask of TTT step `step` in the form the model's attention takes: dense bool for
    sdpa, 0/-inf for eager, a BlockMask for flex."""
    if model._attn_impl == "sdpa":
        return window_dense_mask(doc_ids, position_ids, window, step)
    total = doc_ids.shape[0]
    return model._create_mask_fn(window_mask_mod(doc_ids, position_ids, window, step), B=None, H=None,
                                 Q_LEN=total, KV_LEN=(step + 1) * total, device=doc_ids.device)


def head(model, state: torch.Tensor) -> torch.Tensor:
    """Draft logits from what `unroll(..., states=True)` yields (any subset of its rows)."""
    return model.lm_head(state if model.config.norm_output else model.norm(state))


def unroll(model, aux: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor,
           doc_ids: torch.Tensor, steps: int, *, states: bool = False) -> Iterator[torch.Tensor]:
    """Training-time test over a packed batch: yields the logits [1, S, draft_vocab] of steps
    0..steps-1 (with `states`, the head's input [1, S, H] instead, so a caller can apply the head
    to the rows it needs only). Step k at packed position j predicts token j+k+1 of the (shifted)
    input; its input is the ground-truth token (teacher forcing) and the draft's own hidden state
    of step k-1, and it attends to the step-0 context of its document plus its own earlier steps; under
    a window (window_of), each step sees what vLLM's sliding window lets it see (window_mask_mod)."""
    from speculators.models.eagle3.attention import extend_dense_mask_for_draft_tokens, extend_mask_for_draft_tokens
    from transformers import DynamicCache

    total = aux.shape[1]
    device = aux.device
    cache = DynamicCache()
    window = window_of(model)
    windowed = set(model.sliding_window_indices) if window else set()
    step_positions = position_ids  # the step-0 positions the window is measured from
    mask = None  # the full-attention mask, built only when a layer attends without the window
    if len(windowed) < len(model.layers):
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
        win = window_mask(model, doc_ids, step_positions, window, k) if windowed else None
        for i, layer in enumerate(model.layers):
            hidden = layer(hidden, attention_mask=win if i in windowed else mask, position_ids=position_ids,
                           past_key_values=cache, cache_position=cache_position, position_embeddings=rope)
        if model.config.norm_output:
            hidden = model.norm(hidden)
        yield hidden if states else head(model, hidden)
        if k + 1 == steps:
            break
        ids = torch.cat([input_ids[:, 1 + k:], input_ids.new_zeros(1, 1 + k)], dim=-1)
        if mask is not None:
            mask = extend_mask_for_draft_tokens(mask) if flex else extend_dense_mask_for_draft_tokens(mask, total)
        position_ids = position_ids + 1
