"""The run planner: from the target's config, the data and the flags, what each stage needs
(disk, per-GPU memory, tokens, time) before anything runs. Pure arithmetic over shapes; no
tensors are made. The formulas follow what the stages allocate (see each function); the rates
are either given or the defaults below, each marked where it was measured or "assumed".
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from eagle3_train.common.errors import PipelineError
from eagle3_train.common.hidden_store import bytes_per_token
from eagle3_train.common.target import MLA_DIMS, has_mla, looks_like_hub_id
from eagle3_train.train.budget import auto_epochs

GB = 1e9
DISK_MARGIN = 1.02  # extract.DISK_MARGIN: headers, index, plan
SHARD_HEADER = 4096  # safetensors header + the shard's JSON description, fixed part
SAMPLE_META = 48  # per sample in a shard's description: its id, offset and length
RAW_BYTES_PER_TOKEN = 4.5  # 01b JSONL: text of a BPE token (~4 chars) plus JSON escaping (assumed)

# tok/s per stage, for the whole run (all GPUs); `source` says where the figure comes from.
RATES = {
    "01b": (8.0 * 1000, "assumed: 8 servers x ~1,000 output tok/s of 8K-token reasoning"),
    "02": (3165.0, "measured: the original Kimi-K2.5 run's vLLM extraction (828 GB written)"),
    "04": (40000.0, "assumed: 8 GPUs x ~5,000 tok/s for a one-layer draft at TTT 3"),
    "05": (5000.0, "assumed"),
}


@dataclass
class Shape:
    """The target's text model, as the planner needs it."""
    layers: int
    hidden: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    mla: dict | None = None  # the MLA dims (draft_mla.MLA_DIMS) of a DeepSeek-V3 / Kimi target

    @classmethod
    def from_config(cls, tc) -> Shape:
        """From a transformers config (or any object with the same attributes: the text config)."""
        g = (lambda k, d=None: tc.get(k, d)) if isinstance(tc, dict) else (lambda k, d=None: getattr(tc, k, d))
        hidden, heads = int(g("hidden_size")), int(g("num_attention_heads"))
        return cls(layers=int(g("num_hidden_layers")), hidden=hidden, vocab=int(g("vocab_size")), heads=heads,
                   kv_heads=int(g("num_key_value_heads") or heads), head_dim=hidden // heads,  # as draft.layer_config
                   intermediate=int(g("intermediate_size") or 3 * hidden),
                   mla={k: int(g(k) or 0) for k in MLA_DIMS} if has_mla(tc) else None)


@dataclass
class Flags:
    samples: int
    tokens_per_sample: float
    storage: str = "bf16"
    topk: int = 32
    n_aux: int = 3
    shard_mb: float = 1024.0
    draft_vocab_size: int = 32000
    max_tokens_per_batch: int = 4096
    ttt_steps: int = 3  # 04's default
    draft_arch: str = "auto"  # 04's --draft-arch: auto is the MLA layer for an MLA target, else Llama
    norm_before_fc: bool = True  # 04's default: n_aux x H norm weights before fc (either layer)
    gpus: int = 8
    gpu_memory_gb: float = 96.0
    train_embeddings: bool = False
    train_lm_head: bool = False
    attn: str = "flex"  # flex: no S x S scores; sdpa/eager: dense scores per head
    act_bytes: int = 2  # bf16 autocast on GPU; 4 on CPU
    epochs: int | None = None  # None: 04's default length rule (budget.auto_epochs)
    optimizer: str = "muon"  # 04's default; Muon keeps one fp32 state per matrix weight, AdamW two
    head_chunk: int = 2048  # rows of full-vocabulary logits at a time (02's top-k head, 05's greedy)
    raw_bytes_per_token: float = RAW_BYTES_PER_TOKEN
    tokenized_bytes: int | None = None  # measured from --data instead of estimated
    rates: dict | None = None


def tokens(f: Flags) -> int:
    return int(round(f.samples * f.tokens_per_sample))


def raw_jsonl_bytes(f: Flags) -> int:
    """01b's JSONL: the messages' text plus a few hundred bytes of fields per sample."""
    return int(tokens(f) * f.raw_bytes_per_token + 400 * f.samples)


def tokenized_jsonl_bytes(f: Flags, vocab: int) -> int:
    """01c's data.jsonl: `input_ids` as decimal digits + ',' and `loss_mask` as '0,'/'1,' per token."""
    if f.tokenized_bytes is not None:
        return f.tokenized_bytes
    # ids spread over the vocabulary: the mean count of decimal digits
    digits = sum((d + 1) * (min(vocab, 10 ** (d + 1)) - (10 ** d if d else 0))
                 for d in range(len(str(vocab - 1)))) / vocab
    return int(tokens(f) * (digits + 1 + 2) + 80 * f.samples)


def store_bytes(f: Flags, shape: Shape) -> int:
    """02's shards: tensors, plus per-shard headers that describe their samples, plus DISK_MARGIN."""
    topk = f.topk if f.storage == "fp8-topk" else 0
    data = tokens(f) * bytes_per_token(f.storage, f.n_aux, shape.hidden, topk)
    shards = max(1, math.ceil(data / (f.shard_mb * 1e6)))
    return int((data + shards * SHARD_HEADER + f.samples * SAMPLE_META) * DISK_MARGIN)


def head_bytes(shape: Shape, chunk: int, weight_bytes: int = 2) -> int:
    """A target head on one GPU: lm_head [V, H] + norm, and one chunk of fp32 logits [chunk, V]
    (with its log-softmax beside it)."""
    return shape.vocab * shape.hidden * weight_bytes + shape.hidden * 4 + 2 * chunk * shape.vocab * 4


def steps_per_epoch(f: Flags) -> int:
    """Optimizer steps in one pass: every GPU takes a batch of max_tokens_per_batch per step."""
    return max(1, math.ceil(tokens(f) / (f.max_tokens_per_batch * f.gpus)))


def epochs(f: Flags) -> int:
    return f.epochs or auto_epochs(steps_per_epoch(f))


def is_mla(shape: Shape, f: Flags) -> bool:
    """Which layer 04 builds (train/model.draft_arch): --draft-arch mla, or auto on an MLA target."""
    if f.draft_arch == "mla" and not shape.mla:
        raise PipelineError("--draft-arch mla needs a target with multi-head latent attention (MLA dims in its config)")
    return f.draft_arch == "mla" or (f.draft_arch == "auto" and shape.mla is not None)


def mla_widths(shape: Shape) -> dict[str, int]:
    """Per-token widths of the MLA layer's projections (draft_mla.MlaFirstLayer)."""
    m, n = shape.mla, shape.heads
    return {"q": n * (m["qk_nope_head_dim"] + m["qk_rope_head_dim"]), "q_lora": m["q_lora_rank"],
            "kv_a": m["kv_lora_rank"] + m["qk_rope_head_dim"], "kv_lora": m["kv_lora_rank"],
            "kv_b": n * (m["qk_nope_head_dim"] + m["v_head_dim"]), "o_in": n * m["v_head_dim"]}


def layer_params(shape: Shape, f: Flags) -> int:
    """The one decoder layer: q/k/v (or the MLA latents) over the 2H first-layer input, o, the dense
    MLP, and the norms."""
    H, I = shape.hidden, shape.intermediate
    if is_mla(shape, f):
        w = mla_widths(shape)
        q = (2 * H * w["q_lora"] + w["q_lora"] + w["q_lora"] * w["q"]) if w["q_lora"] else 2 * H * w["q"]
        attn = q + 2 * H * w["kv_a"] + w["kv_lora"] + w["kv_lora"] * w["kv_b"] + w["o_in"] * H
        return attn + 3 * H * I + 3 * H
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    return 2 * H * (q + 2 * kv) + q * H + 3 * H * I + 3 * H  # q/k/v take 2H; o; gate/up/down; 3 norms


def draft_params(shape: Shape, f: Flags) -> dict[str, int]:
    """A one-layer EAGLE-3 draft as wide as the target (draft.build_draft over speculators', or
    draft_mla.build_mla_draft)."""
    H = shape.hidden
    return {"fc": f.n_aux * H * H, "layer": layer_params(shape, f), "norm": H + f.norm_before_fc * f.n_aux * H,
            "lm_head": f.draft_vocab_size * H, "embed": shape.vocab * H}


def layer_activations_per_token(shape: Shape, f: Flags) -> int:
    """Elements autograd keeps per new token and TTT step inside the layer: the 2H input and its
    norms, the attention's projections and output, o, the residuals, MLP gate/up/act/down."""
    H, I = shape.hidden, shape.intermediate
    if is_mla(shape, f):
        w = mla_widths(shape)
        return 4 * H + 2 * w["q_lora"] + 2 * w["q"] + 2 * w["kv_a"] + 2 * w["o_in"] + 3 * H + 3 * I
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    return 4 * H + 2 * q + 2 * kv + 3 * H + 3 * I


def mla_cache_activations(shape: Shape, f: Flags) -> int:
    """What the MLA layer keeps for its keys: TTT step k (0-based) attends to (k+1) x S cached
    positions, whose latents it expands again through kv_b (the latent in, k nope + rope and v
    out); with dense attention also the scores and the mask over those keys (flex keeps neither)."""
    w, S, T = mla_widths(shape), f.max_tokens_per_batch, f.ttt_steps
    keys = S * T * (T + 1) // 2  # cached positions summed over the steps
    k_width = w["kv_lora"] + shape.heads * (shape.mla["qk_nope_head_dim"] + 2 * shape.mla["qk_rope_head_dim"]) \
        + shape.heads * shape.mla["v_head_dim"]
    dense = (shape.heads + 1) * S * keys * 4 if f.attn != "flex" else 0
    return keys * k_width * f.act_bytes + dense


def train_memory(shape: Shape, f: Flags) -> dict[str, int]:
    """04's peak per GPU (DDP: every GPU holds the whole draft): fp32 weights of every parameter,
    fp32 grads + the optimizer state of the trainable ones (state_bytes), the target head's rows and full
    lm_head (for the greedy token) in bf16 unless the store holds top-k, and the activations the
    backward keeps for max_tokens_per_batch tokens over ttt_steps steps."""
    p = draft_params(shape, f)
    trainable = p["fc"] + p["layer"] + p["norm"] + p["lm_head"] * f.train_lm_head + p["embed"] * f.train_embeddings
    total = sum(p.values())
    H, S, a, dv = shape.hidden, f.max_tokens_per_batch, f.act_bytes, f.draft_vocab_size
    # per step and token: the layer's, then the draft logits fp32 with log-softmax and grad, the
    # target's probabilities
    per_tok = layer_activations_per_token(shape, f) * a + 4 * dv * 4
    if is_mla(shape, f):
        attn = mla_cache_activations(shape, f)
    else:
        attn = f.ttt_steps * shape.heads * S * S * 4 if f.attn != "flex" else 0
    head = 0 if f.storage == "fp8-topk" else (shape.vocab + dv) * H * a + 2 * S * dv * 4
    act = f.ttt_steps * S * per_tok + S * f.n_aux * H * a + attn
    out = {"weights": total * 4, "grads_and_adam": trainable * (4 + state_bytes(f)), "target_head": head,
           "activations": act, "trainable_params": trainable, "params": total}
    out["total"] = out["weights"] + out["grads_and_adam"] + head + act
    return out


def state_bytes(f: Flags) -> int:
    """Optimizer state per trainable parameter, fp32: AdamW's two moments, or Muon's momentum (the
    few norm weights it leaves to AdamW are neglected)."""
    return 8 if f.optimizer == "adamw" else 4


def checkpoint_bytes(shape: Shape, f: Flags) -> int:
    """A checkpoint: the trainable weights + the optimizer state, fp32 (weights.pt + optimizer.pt)."""
    return train_memory(shape, f)["trainable_params"] * (4 + state_bytes(f))


def export_bytes(shape: Shape, f: Flags, dtype_bytes: int) -> int:
    """The speculators export: every draft weight in the export dtype, d2t int64 and t2d bool."""
    return sum(draft_params(shape, f).values()) * dtype_bytes + f.draft_vocab_size * 8 + shape.vocab


def hours(n_tokens: int, rate: float) -> float:
    return n_tokens / rate / 3600


def plan(shape: Shape, f: Flags) -> dict:
    """Per stage: disk written, per-GPU memory, tokens and hours, with each rate's source."""
    rates = {k: v for k, v in RATES.items()} | {k: (float(r), "given") for k, r in (f.rates or {}).items() if r}
    n = tokens(f)
    mem = train_memory(shape, f)
    topk_head = head_bytes(shape, f.head_chunk) if f.storage == "fp8-topk" else 0

    def timed(stage, count):
        r, src = rates[stage]
        return {"tokens": count, "rate_tok_s": r, "rate_source": src, "hours": round(hours(count, r), 2)}

    stages = {
        "01b": {"disk": raw_jsonl_bytes(f), **timed("01b", n)},
        "01c": {"disk": tokenized_jsonl_bytes(f, shape.vocab), "tokens": n},
        "02": {"disk": store_bytes(f, shape), "gpu_memory": topk_head,
               "gpu_memory_note": "the top-k head beside vLLM (lm_head bf16 + chunk logits)" if topk_head
               else "vLLM's own (no head: --storage keeps the last hidden state)", **timed("02", n)},
        "04": {"disk": checkpoint_bytes(shape, f) * 3 + export_bytes(shape, f, 2),
               "gpu_memory": mem["total"], "memory_parts": mem,
               "checkpoint": checkpoint_bytes(shape, f), "export_bf16": export_bytes(shape, f, 2),
               "export_fp32": export_bytes(shape, f, 4), "draft": "mla" if is_mla(shape, f) else "llama",
               "epochs": epochs(f), "steps": steps_per_epoch(f) * epochs(f), **timed("04", n * epochs(f))},
        "05": {"gpu_memory": head_bytes(shape, f.head_chunk) + sum(draft_params(shape, f).values()) * 2,
               "gpu_memory_note": "offline: target head bf16 + chunk logits + the draft bf16"},
    }
    for s in stages.values():
        if "gpu_memory" in s:
            s["fits"] = s["gpu_memory"] <= f.gpu_memory_gb * GB
    return {"target": asdict(shape), "flags": asdict(f), "tokens": n, "stages": stages,
            "disk_total": sum(s.get("disk", 0) for s in stages.values())}


def table(p: dict) -> str:
    """The plan as a fixed-width table, one row per stage."""
    def gb(x):
        return "-" if not x else f"{x / GB:,.1f} GB" if x >= 0.1 * GB else f"{x / 1e6:,.1f} MB"

    rows = [f"{'stage':<6}{'disk':>12}{'GPU mem':>12}{'tokens':>16}{'tok/s':>10}{'hours':>9}  rate"]
    for name, s in p["stages"].items():
        rows.append(f"{name:<6}{gb(s.get('disk')):>12}{gb(s.get('gpu_memory')):>12}{s.get('tokens', 0):>16,}"
                    f"{s.get('rate_tok_s', 0):>10,.0f}{s.get('hours', 0):>9.1f}  {s.get('rate_source', '')}")
    m = p["stages"]["04"]["memory_parts"]
    s4 = p["stages"]["04"]
    rows.append(f"04 {s4['draft']} draft layer, {s4['epochs']} epoch(s) = {s4['steps']:,} steps")
    rows.append(f"04 per GPU: weights {gb(m['weights'])}, grads+optimizer {gb(m['grads_and_adam'])}, target head "
                f"{gb(m['target_head'])}, activations {gb(m['activations'])} "
                f"({m['trainable_params'] / 1e6:,.0f}M trainable of {m['params'] / 1e6:,.0f}M)")
    rows.append(f"04 checkpoint {gb(s4['checkpoint'])}; export bf16 {gb(s4['export_bf16'])}, "
                f"fp32 {gb(s4['export_fp32'])}; disk total {gb(p['disk_total'])}")
    return "\n".join(rows)


# ----------------------------------------------------------------------------- --dry-run of 02 and 04

def _target_shape(name_or_path: str) -> Shape:
    from eagle3_train.common.target import target_info

    return Shape.from_config(target_info(name_or_path)[1])


def dry_run_extract(cfg) -> int:
    """02 --dry-run: its plan from the tokenized input's counts, the target's config and the flags."""
    from eagle3_train.extract.stage import InputSet, parse_layers

    inp, shape = InputSet.open(cfg.input), _target_shape(cfg.model)
    counts = inp.manifest.get("counts") or {}
    samples = int(counts.get("samples") or 1)
    f = Flags(samples=samples, tokens_per_sample=inp.tokens / samples, storage=cfg.storage, topk=cfg.topk,
              n_aux=len(parse_layers(cfg.layers, shape.layers)), shard_mb=cfg.shard_mb)
    s = plan(shape, f)["stages"]["02"]
    print(f"02 plan: {s['tokens']:,} tokens, store about {s['disk'] / GB:,.2f} GB ({cfg.storage}), "
          f"head on GPU {s['gpu_memory'] / GB:,.2f} GB, {s['hours']:.1f} h at {s['rate_tok_s']:,.0f} tok/s "
          f"({s['rate_source']}); nothing written")
    return 0


def dry_run_train(cfg) -> int:
    """04 --dry-run: its per-GPU memory, checkpoint and export from the store's and the mapping's
    manifests, the target's config and the flags."""
    from pathlib import Path

    from eagle3_train.common.manifest import read_manifest
    from eagle3_train.train.budget import choose_lr

    store, mapping = read_manifest(Path(cfg.hidden_states)) or {}, read_manifest(Path(cfg.vocab_mapping)) or {}
    shape, counts = _target_shape(cfg.target), store.get("counts") or {}
    samples = int(counts.get("samples") or 1)
    f = Flags(samples=samples, tokens_per_sample=int(counts.get("tokens") or 0) / samples,
              storage=(store.get("storage") or {}).get("format", "bf16"),
              n_aux=len(cfg.aux_layer_ids or store.get("aux_layer_ids") or [0, 0, 0]),
              draft_vocab_size=int((mapping.get("counts") or {}).get("draft_vocab_size") or shape.vocab),
              max_tokens_per_batch=cfg.max_tokens_per_batch, ttt_steps=cfg.ttt_steps, epochs=cfg.epochs,
              optimizer=cfg.optimizer, draft_arch=cfg.draft_arch, norm_before_fc=cfg.norm_before_fc,
              train_embeddings=cfg.train_embeddings, train_lm_head=cfg.train_lm_head,
              attn="flex" if cfg.attn in ("auto", "flex") else cfg.attn)
    s = plan(shape, f)["stages"]["04"]
    lr = choose_lr(cfg.lr, cfg.draft_width(shape.hidden))
    print(f"04 plan: {s['draft']} draft layer, lr {lr['lr']:g} ({lr['lr_why']}); per GPU {s['gpu_memory'] / GB:,.2f} GB at "
          f"{cfg.max_tokens_per_batch} tokens x {cfg.ttt_steps} TTT steps (bf16, flex on CUDA); "
          f"checkpoint {s['checkpoint'] / GB:,.2f} GB, "
          f"export {s['export_bf16'] / GB:,.2f} GB bf16 / {s['export_fp32'] / GB:,.2f} GB fp32; nothing written")
    return 0


# ----------------------------------------------------------------------------- 00_plan

def load_shape(target: str) -> Shape:
    """The target's shape from a model folder or hub id, or from a config JSON file (a wrapper's
    text_config is used when present)."""
    path = Path(target)
    if path.is_file():
        try:
            cfg = json.loads(path.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise PipelineError(f"--target {path}: not a JSON model config ({e})") from None
        cfg = cfg.get("text_config", cfg) if isinstance(cfg, dict) else None
        missing = [k for k in ("hidden_size", "num_hidden_layers", "vocab_size")
                   if not isinstance(cfg, dict) or k not in cfg]
        if missing:
            raise PipelineError(f"--target {path}: not a model's config.json (no {', '.join(missing)})")
        return Shape.from_config(cfg)
    if not path.exists() and not looks_like_hub_id(target):
        raise PipelineError(f"--target {target}: no such folder or file (a model folder, a config JSON or a hub id)")
    from eagle3_train.common.manifest import text_config
    from eagle3_train.common.target import load_target_config

    return Shape.from_config(text_config(load_target_config(target)))


def measure_data(directory: str) -> tuple[int, float, int]:
    """(samples, mean tokens per sample, data.jsonl bytes) of a tokenized set, from its manifest."""
    from eagle3_train.common.manifest import read_manifest

    d = Path(directory)
    counts = (read_manifest(d) or {}).get("counts") or {}
    if not counts.get("samples"):
        raise PipelineError(f"--data {d}: no manifest with sample counts (a finished 01c output)")
    return counts["samples"], counts["tokens"] / counts["samples"], (d / "data.jsonl").stat().st_size


def run(cfg) -> int:
    """00_plan: print the plan of the run `cfg` (a plan.config.PlanConfig) describes."""
    samples, per_sample, measured = cfg.samples, cfg.tokens_per_sample, None
    if cfg.data:
        samples, per_sample, measured = measure_data(cfg.data)
    flags = Flags(samples=samples, tokens_per_sample=per_sample, storage=cfg.storage, topk=cfg.topk,
                  n_aux=cfg.n_aux, draft_vocab_size=cfg.draft_vocab_size,
                  max_tokens_per_batch=cfg.max_tokens_per_batch, ttt_steps=cfg.ttt_steps, epochs=cfg.epochs,
                  draft_arch=cfg.draft_arch, attn="flex" if cfg.attn in ("auto", "flex") else cfg.attn,
                  train_embeddings=cfg.train_embeddings,
                  train_lm_head=cfg.train_lm_head, gpus=cfg.gpus, gpu_memory_gb=cfg.gpu_memory_gb,
                  tokenized_bytes=measured, rates=cfg.rates())
    result = plan(load_shape(cfg.target), flags)
    print(json.dumps(result, indent=1) if cfg.json else table(result))
    return 0
