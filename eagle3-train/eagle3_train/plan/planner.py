"""The run planner: from the target's config, the data and the flags, what each stage needs
(disk, per-GPU memory, tokens, time) before anything runs. Pure arithmetic over shapes; no
tensors are made. The formulas follow what the stages allocate (see each function); the rates
are either given or the defaults below, each marked where it was measured or "assumed".
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from eagle3_train.common.errors import PipelineError
from eagle3_train.common.hidden_store import bytes_per_token
from eagle3_train.common.target import MLA_DIMS, has_mla, looks_like_hub_id
from eagle3_train.plan import gen as G
from eagle3_train.plan.draft import (  # noqa: F401 -- the planner's 04 figures, named here as before
    blocks, checkpoint_bytes, draft_params, export_bytes, is_mla, kind, layer_params, passes_ratio, train_memory)
from eagle3_train.plan.config import gpu_memory_gb
from eagle3_train.train.budget import auto_epochs

GB = 1e9
DISK_MARGIN = 1.02  # extract.DISK_MARGIN: headers, index, plan
SHARD_HEADER = 4096  # safetensors header + the shard's JSON description, fixed part
SAMPLE_META = 48  # per sample in a shard's description: its id, offset and length
RAW_BYTES_PER_TOKEN = 4.5  # 01b JSONL: text of a BPE token (~4 chars) plus JSON escaping (assumed)

# 01b: one vLLM server (tensor parallel over its GPUs) per --gen-servers; its tok/s against the
# answers in flight and the level --concurrency auto reaches are plan/gen.py's model.
# The capturing server runs PIECEWISE CUDA graphs (the hidden-state layer's attention builder declares
# no full-graph support), where a plain vLLM 0.32 server captures full decode graphs: its decode steps
# are assumed this much slower (not measured; the pilot's 01b rates replace the whole curve).
CAPTURE_PIECEWISE_COST = 1.15
GEN_BATCH = 64  # assumed answers in flight when the KV cache is unknown (no --weights-gb)
ACTIVATION_RESERVE_GB = 2.0  # per GPU, what vLLM keeps beside weights and KV cache (activations, graphs; assumed)

# tok/s per stage, for the whole run (all GPUs); `source` says where the figure comes from
# (01b's: gen_rate, from the servers and the answers their KV cache holds).
RATES = {
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
    num_speculative_tokens: int | None = None  # 04's (common/formats.py:speculative_tokens)
    block_size: int | None = None  # 04's --block-size (common/formats.py:dflash_block)
    block_anchors: float | None = None  # 04's --block-anchors (None: 512 a packed batch)
    draft_layers: int = 1  # 04's --draft-layers (n_aux: the target layers they read, as 02 stores them)
    supervised_fraction: float = 0.95  # of a batch's tokens, the answers' (a long reasoning answer after its prompt)
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
    gen_servers: int = 1  # 01b's vLLM servers, each over gpus // gen_servers GPUs (the runbook: one, TP 8)
    gen_prompt_tokens: int = 1024  # 01b's mean prompt (assumed)
    gen_max_tokens: int = 16384  # 01b's --max-tokens (the runbook's)
    gpu_memory_utilization: float = 0.9  # vLLM's --gpu-memory-utilization (its default)
    weights_gb: float | None = None  # the target's weight files; None: unknown, so is the KV cache
    activation_reserve_gb: float = ACTIVATION_RESERVE_GB
    kv_dtype_bytes: int = 2  # the model's bf16: vLLM's KV cache with --kv-cache-dtype auto, the hidden states
    kv_cache_dtype: str = "auto"  # 01b's servers' --kv-cache-dtype: auto (the model's) or fp8 (1 B an element)
    dcp: int = 1  # 01b's servers' --decode-context-parallel-size: each rank keeps 1/dcp of every answer's cache
    answers: dict | None = None  # the answers' length stats (gen.length_stats); None: gen.assumed_answers
    gen_points: list | None = None  # measured (answers in flight, tok/s) of one server; None: gen.BOX_CURVE
    gen_points_source: str | None = None  # where gen_points come from
    cache_tokens: int | None = None  # one server's KV cache in tokens as measured (01b's /metrics); None: computed


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


def hours(n_tokens: int, rate: float) -> float | None:
    return n_tokens / rate / 3600 if rate > 0 else None  # None: it never finishes (nothing fits)


def gen_gpus(f: Flags) -> int:
    """GPUs per 01b server (its tensor-parallel size)."""
    return max(1, f.gpus // f.gen_servers)


def kv_bytes_per_token(shape: Shape, f: Flags) -> int:
    """KV cache bytes one token takes on each GPU of a server. MLA (DeepSeek-V3, Kimi) caches one
    latent per layer, kv_lora_rank + the rope key, and vLLM keeps it whole on every tensor-parallel
    rank; GQA caches K and V of its kv heads, split over the ranks (each holds at least one head).
    --kv-cache-dtype fp8 keeps 1 byte an element. (--decode-context-parallel-size spreads the tokens
    over the ranks instead: serving.)"""
    if shape.mla:
        width = shape.mla["kv_lora_rank"] + shape.mla["qk_rope_head_dim"]
    else:
        width = 2 * math.ceil(shape.kv_heads / gen_gpus(f)) * shape.head_dim
    return width * shape.layers * (1 if f.kv_cache_dtype == "fp8" else f.kv_dtype_bytes)


def hidden_cache_bytes_per_token(shape: Shape, f: Flags) -> int:
    """01b --capture-hidden-states: vLLM's hidden-state cache (extract_hidden_states' cache-only
    layer, HiddenStateCacheSpec: n_aux + 1 states of `hidden` in the model's dtype a token, not
    split over the tensor-parallel ranks), allocated beside the KV cache for prompt + answer
    (assumed in the model's dtype with an fp8 KV cache too: fp8 states would not train a draft)."""
    return (f.n_aux + 1) * shape.hidden * f.kv_dtype_bytes


def answer_dist(f: Flags) -> dict:
    """The answers' length stats: measured (f.answers), else the assumed reasoning distribution whose
    mean is a sample's tokens less its prompt."""
    return f.answers or G.assumed_answers(max(1.0, f.tokens_per_sample - f.gen_prompt_tokens), f.gen_max_tokens)


def gen_tokens(f: Flags) -> int:
    """The tokens 01b generates: every sample's answer (its prompt is prefilled, not decoded)."""
    return int(round(f.samples * answer_dist(f)["mean"]))


def serving(shape: Shape, f: Flags, capture: bool = False) -> dict:
    """01b's servers: per GPU, vLLM's share of the memory (--gpu-memory-utilization) less the
    weights' share and ACTIVATION_RESERVE_GB is KV cache (x --decode-context-parallel-size: each
    rank keeps 1/dcp of every answer's tokens); the tokens a server holds (or as measured: f.cache_tokens),
    and the answers in flight (gen.auto_level): `worst_case` keeps every answer of gen_prompt_tokens +
    gen_max_tokens resident, `concurrency` (what --concurrency auto reaches, the rate's `batch`) fills
    the cache with their typical residency. Without the weights' size the cache is unknown and
    GEN_BATCH is assumed. `capture`: the server 01b --capture-hidden-states needs, whose tokens also
    hold their hidden states (one cache group with MLA, so both caches take the same blocks), whose
    decode steps run 2 tokens an answer (the method's dummy draft) and which cannot use decode context
    parallel (a speculative method)."""
    answers = answer_dist(f)
    dcp = 1 if capture else f.dcp
    out = {"servers": f.gen_servers, "gpus_per_server": gen_gpus(f), "kv_bytes_per_token": kv_bytes_per_token(shape, f),
           "kv_cache_dtype": f.kv_cache_dtype, "dcp": dcp, "request_tokens": f.gen_prompt_tokens + f.gen_max_tokens,
           "typical_tokens": round(f.gen_prompt_tokens + answers["resident"])}
    per_token = out["kv_bytes_per_token"]
    if capture:
        out |= {"hidden_bytes_per_token": hidden_cache_bytes_per_token(shape, f), "tokens_per_step": 2}
        per_token += out["hidden_bytes_per_token"]
    if f.cache_tokens:  # measured: the server's KV cache as 01b read it; states take their share of it
        resident = int(f.cache_tokens * out["kv_bytes_per_token"] // per_token) * dcp // f.dcp
        out["measured_cache"] = True
    elif f.weights_gb is None:  # the same cache holds fewer answers when each token takes more
        return out | {"batch": GEN_BATCH * out["kv_bytes_per_token"] // per_token}
    else:
        weights = f.weights_gb * GB / out["gpus_per_server"]
        kv = max(0.0, f.gpu_memory_gb * GB * f.gpu_memory_utilization - weights - f.activation_reserve_gb * GB)
        out |= {"weights_per_gpu": int(weights), "kv_cache_per_gpu": int(kv), "gpu_tokens": int(kv // per_token)}
        resident = out["gpu_tokens"] * dcp
    levels = G.auto_level(resident, f.gen_prompt_tokens, answers, f.gen_max_tokens)
    return out | {"resident_tokens": resident, "worst_case": levels["worst"], "mean_level": levels["mean_level"],
                  "fill_level": levels["fill"], "concurrency": levels["auto"], "batch": levels["auto"]}


def server_tok_s(serve: dict, f: Flags, level: float) -> float:
    """One server's tok/s at `level` answers in flight (gen.gen_tok_s at their typical context). A
    step yields one token an answer; a step of k tokens an answer (capture: 2) is assumed to cost as
    much as k times the answers' step."""
    k = serve.get("tokens_per_step", 1)
    return G.gen_tok_s(k * level, serve["typical_tokens"], f.gen_points) / k if level else 0.0


def gen_rate(serve: dict, f: Flags) -> tuple[float, str]:
    """01b's tok/s over all servers at the level serving() found, and where it comes from."""
    b, k, n = serve["batch"], serve.get("tokens_per_step", 1), serve["servers"]
    per = server_tok_s(serve, f, b)
    at = (f"{b} answers in flight (--concurrency auto" + (f", {b * n} in all" if n > 1 else "") + ")"
          if "concurrency" in serve else f"{b} answers in flight (KV cache unknown: pass --weights-gb)")
    src = f.gen_points_source or G.curve_source(f.gen_points, "01b")
    return n * per, (f"{n} server{'s' if n > 1 else ''} x {per:,.0f} tok/s at {at}"
                     + (f", {k} tokens a step" if k > 1 else "") + f"; {src}")


def fixed_levels(serve: dict, f: Flags, n_tokens: int) -> list[dict]:
    """Hours at the fixed --concurrency a user might pick (gen.FIXED_LEVELS and the worst case): the
    servers share the level; above what the cache holds (typical residencies filling it) vLLM
    preempts and recomputes, so the rate is that level's at best."""
    n = serve["servers"]
    levels = set(G.FIXED_LEVELS) | ({serve["worst_case"] * n} if serve.get("worst_case") else set())
    rows = []
    for total in sorted(levels):
        share = math.ceil(total / n)
        over = "fill_level" in serve and share > serve["fill_level"]
        rate = n * server_tok_s(serve, f, serve["fill_level"] if over else share)
        h = hours(n_tokens, rate)
        rows.append({"concurrency": total, "tok_s": round(rate, 1), "hours": None if h is None else round(h, 2),
                     "over_cache": over})
    return rows


def with_measured(f: Flags, serve: dict) -> Flags:
    """A given --rate-01b is a measured point at the level serving() found: the curve scales to it."""
    given = (f.rates or {}).get("01b")
    if not given or f.gen_points or not serve["batch"]:
        return f
    return replace(f, gen_points=[(serve["batch"], given / serve["servers"])], gen_points_source="given --rate-01b")


def options(shape: Shape, f: Flags) -> list[dict]:
    """01b's auto level and hours with the cache options the plan does not use (fp8 KV, decode
    context parallel over the server's GPUs, both), for the line that offers them."""
    out = []
    for dtype, dcp in (("fp8", f.dcp), ("auto" if f.kv_cache_dtype == "auto" else "fp8", gen_gpus(f)),
                       ("fp8", gen_gpus(f))):
        if (dtype, dcp) == (f.kv_cache_dtype, f.dcp) or any(o["kv_cache_dtype"] == dtype and o["dcp"] == dcp
                                                            for o in out):
            continue
        g = replace(f, kv_cache_dtype=dtype, dcp=dcp, cache_tokens=None)
        s = serving(shape, g)
        if "concurrency" not in s:
            continue
        rate = gen_rate(s, g)[0]
        h = hours(gen_tokens(g), rate)
        out.append({"kv_cache_dtype": dtype, "dcp": dcp, "resident_tokens": s["resident_tokens"],
                    "concurrency": s["concurrency"] * s["servers"], "tok_s": round(rate, 1),
                    "hours": None if h is None else round(h, 2)})
    return out


def plan(shape: Shape, f: Flags) -> dict:
    """Per stage: disk written, per-GPU memory, tokens and hours, with each rate's source."""
    serve = serving(shape, f)
    f = with_measured(f, serve)
    rates = RATES | {"01b": gen_rate(serve, f)} | {k: (float(r), "given") for k, r in (f.rates or {}).items() if r}
    if f.draft_layers > 1 and rates["04"][1] != "given":  # the assumed rate is a one-layer draft's
        ratio = passes_ratio(shape, f)
        rates["04"] = (rates["04"][0] / ratio, f"{rates['04'][1]}, / {ratio:.2f} for {f.draft_layers} layers' weights "
                                               "a token passes")
    n = tokens(f)
    mem = train_memory(shape, f)
    topk_head = head_bytes(shape, f.head_chunk) if f.storage == "fp8-topk" else 0

    def timed(stage, count):
        r, src = rates[stage]
        h = hours(count, r)
        return {"tokens": count, "rate_tok_s": r, "rate_source": src, "hours": None if h is None else round(h, 2)}

    gen = {"disk": raw_jsonl_bytes(f), **timed("01b", gen_tokens(f)), "serving": serve, "answers": answer_dist(f),
           "fixed": fixed_levels(serve, f, gen_tokens(f)),
           "options": options(shape, f) if f.cache_tokens is None and "weights_per_gpu" in serve else []}
    if "weights_per_gpu" in serve:  # what vLLM needs before any KV cache; it fits when one answer does
        gen |= {"gpu_memory": serve["weights_per_gpu"] + int(f.activation_reserve_gb * GB),
                "fits": serve["concurrency"] >= 1}
    elif "concurrency" in serve:
        gen["fits"] = serve["concurrency"] >= 1
    stages = {
        "01b": gen,
        "01c": {"disk": tokenized_jsonl_bytes(f, shape.vocab), "tokens": n},
        "02": {"disk": store_bytes(f, shape), "gpu_memory": topk_head,
               "gpu_memory_note": "the top-k head beside vLLM (lm_head bf16 + chunk logits)" if topk_head
               else "vLLM's own (no head: --storage keeps the last hidden state)", **timed("02", n)},
        "04": {"disk": checkpoint_bytes(shape, f) * 3 + export_bytes(shape, f, 2),
               "gpu_memory": mem["total"], "memory_parts": mem,
               "checkpoint": checkpoint_bytes(shape, f), "export_bf16": export_bytes(shape, f, 2),
               "export_fp32": export_bytes(shape, f, 4), "draft": kind(shape, f),
               "block_size": blocks(f) if kind(shape, f) == "dflash" else None,
               "epochs": epochs(f), "steps": steps_per_epoch(f) * epochs(f), **timed("04", n * epochs(f))},
        "05": {"gpu_memory": head_bytes(shape, f.head_chunk) + sum(draft_params(shape, f).values()) * 2,
               "gpu_memory_note": "offline: target head bf16 + chunk logits + the draft bf16"},
    }
    for s in stages.values():
        if "gpu_memory" in s:
            s.setdefault("fits", s["gpu_memory"] <= f.gpu_memory_gb * GB)
    return {"target": asdict(shape), "flags": asdict(f), "tokens": n, "stages": stages,
            "disk_total": sum(s.get("disk", 0) for s in stages.values()),
            "capture": capture_path(shape, f, stages)}


def pinned_buffer_bytes(request_bytes: int) -> int:
    """The connector's host copy of one request's states: rank 0 gathers them from every rank into
    a pinned buffer rounded up to a power of two, cached while the request is in flight."""
    return 1 << max(0, int(request_bytes) - 1).bit_length()


def capture_path(shape: Shape, f: Flags, stages: dict) -> dict:
    """The other way to 02's store: 01b --capture-hidden-states, which keeps the states vLLM computes
    while generating (serving(capture=True): fewer answers resident, 2 tokens a step) and needs no 02;
    against the two passes, 01b then 02 (a second prefill of every answer). Disk: the same answers and
    store, plus the connector's per-request files of the answers in flight (deleted once repacked)."""
    serve = serving(shape, f, capture=True)
    rate, src = gen_rate(serve, with_measured(f, serving(shape, f)))  # a given plain rate scales the curve
    rate /= CAPTURE_PIECEWISE_COST
    src += f"; / {CAPTURE_PIECEWISE_COST} for PIECEWISE CUDA graphs (assumed; the pilot measures it)"
    h = hours(gen_tokens(f), rate)
    gen, ex = stages["01b"], stages["02"]
    in_flight = serve.get("concurrency", serve["batch"]) * serve["servers"]
    request_states = serve["request_tokens"] * serve["hidden_bytes_per_token"]
    row = {"disk": gen["disk"] + ex["disk"], "scratch_disk": in_flight * request_states,
           "host_memory": in_flight * pinned_buffer_bytes(request_states), "tokens": gen_tokens(f), "rate_tok_s": rate,
           "rate_source": src, "hours": None if h is None else round(h, 2), "serving": serve}
    if "fits" in gen:
        row["fits"] = serve["concurrency"] >= 1
    two = None if gen["hours"] is None or ex["hours"] is None else round(gen["hours"] + ex["hours"], 2)
    out = {"01b": row, "two_pass": {"hours": two, "disk": gen["disk"] + ex["disk"]}, "cheaper": None}
    if two is not None or row["hours"] is not None:  # None: never finishes
        cap_first = two is None or (row["hours"] is not None and row["hours"] < two)
        out["cheaper"] = "capture" if cap_first else "two_pass"
        out["saves_hours"] = None if None in (two, row["hours"]) else round(abs(two - row["hours"]), 2)
        out["saves_disk"] = row["disk"] + row["scratch_disk"] - out["two_pass"]["disk"] if not cap_first \
            else out["two_pass"]["disk"] - row["disk"] - row["scratch_disk"]
    return out


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


def local_weights_gb(target: str) -> float | None:
    """The weight files' GB of a model folder here; None for a config file, a hub id or a folder without them."""
    from eagle3_train.common.vllm_server import weights_gb

    return weights_gb(target) or None


def measured_file(cfg) -> Path | None:
    """--measured, else <--work-dir>/pilot/gen_rates.json when the pilot left one."""
    if cfg.measured:
        return Path(cfg.measured)
    if cfg.work_dir and (Path(cfg.work_dir) / "pilot" / "gen_rates.json").exists():
        return Path(cfg.work_dir) / "pilot" / "gen_rates.json"
    return None


def flags_from(cfg, shape: Shape | None = None) -> Flags:
    """00_plan's Flags from its config: --data's counts and lengths, the measured file's rates,
    lengths and cache (the measured file's lengths unless --data gives the run's own); with the
    target's `shape`, the layers 02 stores (--n-aux, or --target-layers per-draft-layer's)."""
    samples, per_sample, measured, answers, prompt = cfg.samples, cfg.tokens_per_sample, None, None, None
    if cfg.data:
        from eagle3_train.plan.data import measure_data

        data = measure_data(cfg.data)
        samples, per_sample, measured = data["samples"], data["tokens_per_sample"], data["tokenized_bytes"]
        answers, prompt = data["answers"], data["prompt_tokens"]
    points = cache = source = None
    path = measured_file(cfg)
    if path is not None:
        m = G.read_measured(path)
        points = [(p["level"], p["tok_s"]) for p in m["points"]] or None
        source = G.curve_source(points, str(path)) if points else None
        cache = m.get("cache_tokens") if cfg.kv_cache_dtype == m.get("kv_cache_dtype", "auto") and \
            cfg.decode_context_parallel_size == m.get("dcp", 1) else None  # another cache: computed instead
        if answers is None and m.get("answers"):
            answers = m["answers"] | {"source": f"measured: {path}, {m['answers'].get('count') or '?'} answers"}
            prompt = m.get("prompt_tokens")
    return Flags(samples=samples, tokens_per_sample=per_sample, storage=cfg.storage, topk=cfg.topk,
                 n_aux=cfg.stored_layers(shape.layers) if shape else cfg.n_aux, draft_layers=cfg.draft_layers,
                 draft_vocab_size=cfg.draft_vocab_size,
                 max_tokens_per_batch=cfg.max_tokens_per_batch, ttt_steps=cfg.ttt_steps, epochs=cfg.epochs,
                 draft_arch=cfg.draft_arch, num_speculative_tokens=cfg.num_speculative_tokens,
                 block_size=cfg.block_size, attn="flex" if cfg.attn in ("auto", "flex") else cfg.attn,
                 train_embeddings=cfg.train_embeddings,
                 train_lm_head=cfg.train_lm_head, gpus=cfg.gpus,
                 gpu_memory_gb=gpu_memory_gb(cfg.gpu_memory_gb),
                 tokenized_bytes=measured, rates=cfg.rates(), gen_servers=cfg.gen_servers,
                 gen_prompt_tokens=prompt or cfg.gen_prompt_tokens, gen_max_tokens=cfg.gen_max_tokens,
                 gpu_memory_utilization=cfg.gpu_memory_utilization,
                 weights_gb=cfg.weights_gb if cfg.weights_gb is not None else local_weights_gb(cfg.target),
                 kv_cache_dtype=cfg.kv_cache_dtype, dcp=cfg.decode_context_parallel_size, answers=answers,
                 gen_points=points, gen_points_source=source, cache_tokens=cache)
