"""Forward times on the user's box, modelled (for common/serving_rate.py): the target's verify and
a draft's forward as tables of (tokens in flight, ms). Pure arithmetic over the model's config.

Decode on the box is memory-bound: a forward reads the weights it uses once, whatever the tokens
(each GPU its 1/TP share), and the KV cache of every sequence; its arithmetic only matters at many
tokens. So a forward of n tokens takes

    layers x a fixed cost a layer (launches, the two all-reduces a layer over PCIe)
    + max(bytes read / (bandwidth x share), flops / effective flops)           per GPU

where an MoE's bytes grow with the experts the n tokens touch: 1 - (1 - top_k / E)^(s n) of them,
s < 1 when the router sends a batch's tokens to fewer experts than independent draws would.
The fixed cost a layer and s are fitted to the box's two public decode figures (plan/gen.py's
BOX_CURVE: 98 tok/s at 1 answer, 1,130 at 32, short context, fp8 KV); the bandwidth and flops are
the card's, with an assumed reachable share. A draft runs at the target's tensor-parallel size
(vLLM's default) and pays the same fixed cost a layer, plus one for its fc / lm_head.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from eagle3_train.common.errors import PipelineError
from eagle3_train.common.serving_rate import Forward, forward
from eagle3_train.plan.draft import draft_params
from eagle3_train.plan.gen import BOX_CURVE, SHORT_CONTEXT
from eagle3_train.plan.planner import Flags, Shape

# Kimi-K2.5 INT4: the routed experts in int4 with a bf16 scale a group of 32 (0.5 + 2 / 32 bytes a
# weight); attention, the dense and shared MLPs, the router and lm_head stay bf16.
EXPERT_BYTES = 0.5 + 2 / 32
TOKENS = tuple(2 ** i for i in range(13))  # the table's points: 1 .. 4,096 tokens in flight


@dataclass(frozen=True)
class Box:
    """The user's box: 8x RTX PRO 6000 Blackwell (96 GB GDDR7, PCIe, no NVLink), TP 8."""
    gpus: int = 8
    bandwidth_gb_s: float = 1792.0  # the card's spec: GDDR7, 512-bit at 28 Gbps
    bandwidth_share: float = 0.85  # assumed: what decode kernels reach of it
    tflops: float = 125.0  # assumed effective bf16 a GPU: about half the card's dense peak (w4a16 MoE, Triton MLA)
    kv_dtype_bytes: int = 2  # the target's KV cache: bf16 (--kv-cache-dtype fp8: 1)
    fixed_layer_ms: float | None = None  # fitted: calibrate()
    routing_share: float | None = None  # fitted: s above (1.0 for a dense target)
    kv_per: str = "seq"  # TRITON_MLA runs a program per query row, but a request's rows run side by side
    # and share its cache's reads in L2 (assumed): DRAM traffic a sequence; its arithmetic counts per row


def _g(cfg: dict, key: str, default=0):
    v = cfg.get(key)
    return default if v is None else v


def target_weights(cfg: dict) -> dict:
    """Parameters (all GPUs) of a target's text model by what a forward reads: `always` (bf16:
    attention, dense MLPs, shared experts, routers, lm_head), `experts` (every routed expert,
    EXPERT_BYTES a weight), `active` (weights a token multiplies), `experts_n`, `top_k`."""
    H, L, V = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    heads = cfg["num_attention_heads"]
    if cfg.get("kv_lora_rank"):
        nope, rope, vd = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
        ql, kvl = _g(cfg, "q_lora_rank"), cfg["kv_lora_rank"]
        q = H * ql + ql * heads * (nope + rope) if ql else H * heads * (nope + rope)
        attn = q + H * (kvl + rope) + kvl * heads * (nope + vd) + heads * vd * H
    else:
        hd = _g(cfg, "head_dim") or H // heads
        attn = H * (heads + 2 * _g(cfg, "num_key_value_heads", heads)) * hd + heads * hd * H
    E = _g(cfg, "n_routed_experts")
    dense_layers = min(L, _g(cfg, "first_k_dense_replace", 1)) if E else L
    moe_layers = L - dense_layers
    I, mI = cfg["intermediate_size"], _g(cfg, "moe_intermediate_size")
    shared = _g(cfg, "n_shared_experts", 1) * 3 * H * mI if E else 0
    always = L * attn + dense_layers * 3 * H * I + moe_layers * (shared + H * E) + V * H
    expert = 3 * H * mI
    top_k = _g(cfg, "num_experts_per_tok")
    return {"always": always, "experts": moe_layers * E * expert, "experts_n": E, "top_k": top_k,
            "active": always + moe_layers * top_k * expert}


def attention_per_row(cfg: dict, gpus: int, context: int, layers: int | None = None) -> tuple[float, float]:
    """(flops a query row on one GPU, KV bytes a sequence on one GPU) over `context` cached tokens.
    MLA (absorbed, as vLLM decodes): every head scores the latent + rope key and sums the latent;
    the latent cache is whole on every rank. GQA: q.k and p.v over head_dim; kv heads split."""
    L = layers if layers is not None else cfg["num_hidden_layers"]
    heads = cfg["num_attention_heads"]
    if cfg.get("kv_lora_rank"):
        width = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
        return 2.0 * context * (heads / gpus) * (width + cfg["kv_lora_rank"]) * L, context * width * L
    hd = _g(cfg, "head_dim") or cfg["hidden_size"] // heads
    kv = math.ceil(_g(cfg, "num_key_value_heads", heads) / gpus)
    return 4.0 * context * (heads / gpus) * hd * L, context * 2 * kv * hd * L


def _ms(box: Box, fixed_layers: float, byte_count: float, flops: float) -> float:
    bw = box.bandwidth_gb_s * 1e9 * box.bandwidth_share
    return fixed_layers * box.fixed_layer_ms + 1000.0 * max(byte_count / bw, flops / (box.tflops * 1e12))


def target_ms(cfg: dict, box: Box, tokens: float, context: int) -> float:
    """The table's time: a forward of `tokens` query rows (KV reads left to the Forward's kv_ms)."""
    w = target_weights(cfg)
    touched = 1.0 - (1.0 - w["top_k"] / w["experts_n"]) ** (box.routing_share * tokens) if w["experts_n"] else 0.0
    byte_count = (2.0 * w["always"] + EXPERT_BYTES * w["experts"] * touched) / box.gpus
    attn_flops, _ = attention_per_row(cfg, box.gpus, context)
    flops = tokens * (2.0 * w["active"] / box.gpus + attn_flops)
    return _ms(box, cfg["num_hidden_layers"], byte_count, flops)


def kv_ms(cfg: dict, box: Box, context: int, dtype_bytes: int, layers: int | None = None) -> float:
    _, kv_bytes = attention_per_row(cfg, box.gpus, context, layers)
    return 1000.0 * kv_bytes * dtype_bytes / (box.bandwidth_gb_s * 1e9 * box.bandwidth_share)


def target_forward(cfg: dict, box: Box, context: int) -> Forward:
    pts = [(n, target_ms(cfg, box, n, context)) for n in TOKENS]
    return forward(pts, "the target's modelled forward", kv_ms=kv_ms(cfg, box, context, box.kv_dtype_bytes),
                   kv_per=box.kv_per, source=f"modelled: {cfg.get('_name', 'target')} on the box, context {context:,}")


def calibrate(kimi_cfg: dict, box: Box = Box(), curve=BOX_CURVE) -> Box:
    """The box's fixed cost a layer and routing share, fitted to its public decode figures for
    Kimi-K2.5 INT4 (1 and 32 answers at a short context, fp8 KV): a step of c answers is c tokens
    over c sequences, c / tok_s seconds. One equation each; bisection on the routing share."""
    pts = dict(curve)
    if 1 not in pts or 32 not in pts:
        raise PipelineError("the box's curve needs its 1- and 32-answer points to calibrate")
    t1, t32 = 1000.0 / pts[1], 32_000.0 / pts[32]
    layers, fp8 = kimi_cfg["num_hidden_layers"], replace(box, kv_dtype_bytes=1)

    def rest(n: int, share: float) -> float:  # the time beyond the fixed cost
        b = replace(fp8, fixed_layer_ms=0.0, routing_share=share)
        return target_ms(kimi_cfg, b, n, SHORT_CONTEXT) + n * kv_ms(kimi_cfg, b, SHORT_CONTEXT, 1)

    def fixed(share: float) -> float:
        return (t1 - rest(1, share)) / layers

    lo, hi = 1e-3, 1.0  # t32 - model(32) falls as the share grows
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if layers * fixed(mid) + rest(32, mid) < t32 else (lo, mid)
    share = (lo + hi) / 2
    if fixed(share) <= 0:
        raise PipelineError("the box's curve cannot be fitted: its 1-answer time is below the bytes it reads")
    return replace(box, fixed_layer_ms=fixed(share), routing_share=share)


def draft_forward(cfg: dict, box: Box, arch: str, context: int, layers: int = 1, n_aux: int = 3,
                  draft_vocab: int = 32000) -> Forward:
    """A draft as wide as the target (plan/draft.py's parameter counts): `arch` mla / llama (an
    EAGLE-3 layer) or dflash (`layers` Qwen3 layers), bf16, split over the box's GPUs; every
    layer's fixed cost plus one for fc / lm_head; its own KV cache (MLA: the latent; else kv heads)."""
    shape = Shape.from_config(cfg)
    f = Flags(samples=1, tokens_per_sample=1, draft_arch=arch, n_aux=n_aux, draft_vocab_size=draft_vocab,
              draft_layers=layers)
    p = draft_params(shape, f)  # "layer": every one of its layers
    weights = p["fc"] + p["norm"] + p["lm_head"] + p["layer"]
    mla = arch == "mla"
    dcfg = cfg if mla else {"hidden_size": shape.hidden, "num_attention_heads": shape.heads,
                            "num_key_value_heads": shape.kv_heads, "head_dim": shape.head_dim,
                            "num_hidden_layers": layers}
    attn_flops, _ = attention_per_row(dcfg, box.gpus, context, layers)
    pts = [(n, _ms(box, layers + 1, 2.0 * weights / box.gpus, n * (2.0 * weights / box.gpus + attn_flops)))
           for n in TOKENS]
    return forward(pts, f"the {arch} draft's modelled forward", kv_ms=kv_ms(dcfg, box, context, 2, layers),
                   kv_per=box.kv_per if mla else "seq",
                   source=f"modelled: {arch} draft, {layers} layer(s), {weights / 1e6:,.0f}M parameters")
