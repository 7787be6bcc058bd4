"""What 04's draft holds, for 00_plan and 04 --dry-run: its parameters, checkpoint and export, and
its peak memory per GPU, for each layer 04 builds (the Llama/Qwen3 EAGLE-3 layer, the MLA layer, the
DFlash block draft) and --draft-layers of them (`f.draft_layers`; the MLA draft has one). `shape` is
a planner.Shape, `f` a planner.Flags; tests/test_planner.py holds each figure against what a tiny run
writes and keeps."""

from __future__ import annotations

from eagle3_train.common.errors import PipelineError
from eagle3_train.common.formats import dflash_block


def kind(shape, f) -> str:
    """Which draft 04 builds (train/draft.py:resolve_arch): --draft-arch, or auto: the MLA layer for
    an MLA target (DeepSeek-V3 / Kimi), the Llama layer otherwise."""
    if f.draft_arch == "mla" and not shape.mla:
        raise PipelineError("--draft-arch mla needs a target with multi-head latent attention (MLA dims in its config)")
    if f.draft_arch == "auto":
        return "mla" if shape.mla else "llama"
    return f.draft_arch


def is_mla(shape, f) -> bool:
    return kind(shape, f) == "mla"


def blocks(f) -> int:
    """DFlash's block, by 04's rule (common/formats.py:dflash_block)."""
    return dflash_block(f.block_size, f.num_speculative_tokens)


def mla_widths(shape) -> dict[str, int]:
    """Per-token widths of the MLA layer's projections (draft_mla.MlaFirstLayer)."""
    m, n = shape.mla, shape.heads
    return {"q": n * (m["qk_nope_head_dim"] + m["qk_rope_head_dim"]), "q_lora": m["q_lora_rank"],
            "kv_a": m["kv_lora_rank"] + m["qk_rope_head_dim"], "kv_lora": m["kv_lora_rank"],
            "kv_b": n * (m["qk_nope_head_dim"] + m["v_head_dim"]), "o_in": n * m["v_head_dim"]}


def layer_params(shape, f, first: bool = True) -> int:
    """One decoder layer: q/k/v (or the MLA latents) over the 2H first-layer input (H for a DFlash
    layer, whose queries are token embeddings, and for an EAGLE-3 draft's later layers), o, the
    dense MLP, and the norms (DFlash's Qwen3 layer adds q_norm / k_norm)."""
    H, I = shape.hidden, shape.intermediate
    arch = kind(shape, f)
    if arch == "mla":
        w = mla_widths(shape)
        q = (2 * H * w["q_lora"] + w["q_lora"] + w["q_lora"] * w["q"]) if w["q_lora"] else 2 * H * w["q"]
        attn = q + 2 * H * w["kv_a"] + w["kv_lora"] + w["kv_lora"] * w["kv_b"] + w["o_in"] * H
        return attn + 3 * H * I + 3 * H
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    if arch == "dflash":
        return H * (q + 2 * kv) + q * H + 3 * H * I + 2 * H + 2 * shape.head_dim
    if not first:  # speculators' later EAGLE-3 layers: a plain decoder layer over H, two norms
        return H * (q + 2 * kv) + q * H + 3 * H * I + 2 * H
    return 2 * H * (q + 2 * kv) + q * H + 3 * H * I + 3 * H  # q/k/v take 2H; o; gate/up/down; 3 norms


def draft_params(shape, f) -> dict[str, int]:
    """A draft of f.draft_layers layers as wide as the target (draft.build_draft over speculators',
    draft_mla.build_mla_draft, or draft_dflash.build_dflash_draft: its fc over the f.n_aux target
    layers it reads, fc's hidden_norm, the final norm and the trained mask embedding)."""
    H = shape.hidden
    norm = 3 * H if kind(shape, f) == "dflash" else H + f.norm_before_fc * f.n_aux * H
    layers = layer_params(shape, f) + (f.draft_layers - 1) * layer_params(shape, f, first=False)
    return {"fc": f.n_aux * H * H, "layer": layers, "norm": norm,
            "lm_head": f.draft_vocab_size * H, "embed": shape.vocab * H}


def passes_ratio(shape, f) -> float:
    """The weights a trained token passes through (fc, the layers, lm_head), over those of the one-layer
    draft reading the same layers: what 00 scales 04's assumed one-layer tok/s by."""
    from dataclasses import replace

    def passes(flags) -> int:
        p = draft_params(shape, flags)
        return p["fc"] + p["layer"] + p["lm_head"]

    return passes(f) / passes(replace(f, draft_layers=1))


def layer_activations_per_token(shape, f) -> int:
    """Elements autograd keeps per new token and TTT step inside the layer: the 2H input and its
    norms, the attention's projections and output, o, the residuals, MLP gate/up/act/down."""
    H, I = shape.hidden, shape.intermediate
    if is_mla(shape, f):
        w = mla_widths(shape)
        return 4 * H + 2 * w["q_lora"] + 2 * w["q"] + 2 * w["kv_a"] + 2 * w["o_in"] + 3 * H + 3 * I
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    return 4 * H + 2 * q + 2 * kv + 3 * H + 3 * I


def mla_cache_activations(shape, f) -> int:
    """What the MLA layer keeps for its keys: TTT step k (0-based) attends to (k+1) x S cached
    positions, whose latents it expands again through kv_b (the latent in, k nope + rope and v
    out); with dense attention also the scores and the mask over those keys (flex keeps neither)."""
    w, S, T = mla_widths(shape), f.max_tokens_per_batch, f.ttt_steps
    keys = S * T * (T + 1) // 2  # cached positions summed over the steps
    k_width = w["kv_lora"] + shape.heads * (shape.mla["qk_nope_head_dim"] + 2 * shape.mla["qk_rope_head_dim"]) \
        + shape.heads * shape.mla["v_head_dim"]
    dense = (shape.heads + 1) * S * keys * 4 if f.attn != "flex" else 0
    return keys * k_width * f.act_bytes + dense


def dflash_activations(shape, f) -> int:
    """What the DFlash objective keeps for one packed batch of S tokens (objective_dflash.py): the
    context's fc -> hidden_norm states and each layer's keys/values over them; per block query
    (--block-anchors anchors among the supervised positions, x the block) each layer's projections,
    norms and MLP; the mask slots' draft logits with their log-softmax and gradient; and the
    attention mask over the context + the queries, which the fused sdpa kernel keeps in the
    activations' dtype (it keeps no per-head scores)."""
    H, I, S, a = shape.hidden, shape.intermediate, f.max_tokens_per_batch, f.act_bytes
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    block = blocks(f)
    cand = max(1, int(S * f.supervised_fraction))
    if f.block_anchors is None:  # 04's default: a fixed number over the packed batch
        anchors = min(512, cand)
    elif f.block_anchors < 1:  # a share of each sequence's supervised positions
        anchors = max(1, int(cand * f.block_anchors))
    else:  # a count per sequence, times the sequences a batch holds
        anchors = min(cand, int(f.block_anchors) * max(1, int(S // max(f.tokens_per_sample, 1))))
    queries = anchors * block
    per_query = (6 * H + 3 * q + 4 * kv + 4 * I) * a * f.draft_layers
    context = S * (2 * H + 4 * kv * f.draft_layers) * a
    logits = anchors * (block - 1) * 4 * f.draft_vocab_size * 4
    mask = queries * (S + queries) * a
    return int(context + queries * per_query + logits + mask)


def train_memory(shape, f) -> dict[str, int]:
    """04's peak per GPU (DDP: every GPU holds the whole draft): fp32 weights of every parameter,
    fp32 grads + the optimizer state of the trainable ones (state_bytes), the target head's rows and full
    lm_head (for the greedy token) in bf16 unless the store holds top-k, and the activations the
    backward keeps for max_tokens_per_batch tokens over the draft's steps."""
    p = draft_params(shape, f)
    trainable = p["fc"] + p["layer"] + p["norm"] + p["lm_head"] * f.train_lm_head + p["embed"] * f.train_embeddings
    total = sum(p.values())
    H, S, a, dv = shape.hidden, f.max_tokens_per_batch, f.act_bytes, f.draft_vocab_size
    head = 0 if f.storage == "fp8-topk" else (shape.vocab + dv) * H * a + 2 * S * dv * 4
    if kind(shape, f) == "dflash":
        act = dflash_activations(shape, f) + S * f.n_aux * H * a
    else:
        # per step and token: the layer's, then the draft logits fp32 with log-softmax and grad, the
        # target's probabilities
        per_tok = layer_activations_per_token(shape, f) * f.draft_layers * a + 4 * dv * 4
        if is_mla(shape, f):
            attn = mla_cache_activations(shape, f)
        else:
            attn = f.ttt_steps * shape.heads * S * S * 4 if f.attn != "flex" else 0
        act = f.ttt_steps * S * per_tok + S * f.n_aux * H * a + attn
    out = {"weights": total * 4, "grads_and_adam": trainable * (4 + state_bytes(f)), "target_head": head,
           "activations": act, "trainable_params": trainable, "params": total}
    out["total"] = out["weights"] + out["grads_and_adam"] + head + act
    return out


def state_bytes(f) -> int:
    """Optimizer state per trainable parameter, fp32: AdamW's two moments, or Muon's momentum (the
    few norm weights it leaves to AdamW are neglected)."""
    return 8 if f.optimizer == "adamw" else 4


def checkpoint_bytes(shape, f) -> int:
    """A checkpoint: the trainable weights + the optimizer state, fp32 (weights.pt + optimizer.pt)."""
    return train_memory(shape, f)["trainable_params"] * (4 + state_bytes(f))


def export_bytes(shape, f, dtype_bytes: int) -> int:
    """The speculators export: every draft weight in the export dtype, d2t int64 and t2d bool. A
    DFlash export leaves out the frozen embeddings (vLLM shares the target's) and ships the mask
    embedding beside them (mask_embedding.pt)."""
    p = draft_params(shape, f)
    weights = sum(p.values())
    if kind(shape, f) == "dflash" and not f.train_embeddings:
        weights -= p["embed"]
    return weights * dtype_bytes + f.draft_vocab_size * 8 + shape.vocab
