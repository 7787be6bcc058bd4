"""The EAGLE-3 draft, built on speculators 0.9.0's `Eagle3DraftModel` / `Eagle3SpeculatorConfig`.

- `layer_config` / `build_draft`: a one-layer Llama-style (or Qwen3-style) draft for a target, with
  the vocab mapping, `eagle_aux_hidden_state_layer_ids` and `target_hidden_size` set explicitly.
- `build_draft` / `export_draft` also dispatch to draft_mla.py for `--draft-arch mla`; what both
  layers share (the target's weights and head, the training-time-test unroll) is in draft_core.py.
- `export_draft`: the directory in speculators' eagle3 format vLLM serves (`method: eagle3`).

Where speculators 0.9.0 stops: its `fc` is sized `n_aux * draft_hidden` and its verifier loading
refuses a target whose hidden size differs from the draft's. A draft narrower than the target
therefore gets `fc` rebuilt to `n_aux * target_hidden -> draft_hidden` (what vLLM's Eagle3 Llama
builds from `target_hidden_size`) and its own trainable `embed_tokens`, which the export carries.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from torch import nn

from eagle3_train.common.errors import PipelineError
from eagle3_train.common.formats import DRAFT_LAYERS
from eagle3_train.common.manifest import text_config
from eagle3_train.common.store import TMP_PREFIX, atomic_dir_commit
from eagle3_train.train.draft_core import rows_from_target, window_of

# ----------------------------------------------------------------------------- the draft

def step_norms(arch: str, norm_before_residual: bool | None, norm_output: bool | None) -> tuple[bool, bool]:
    """04's --norm-before-residual / --norm-output, None resolved by the layer: on for Llama/Qwen3
    (they keep the state fed between steps in range past the TTT horizon: k = 7 AL 6.34 -> 7.39),
    off for MLA (no gain at k = 7, -0.15 at k = 3), and for a DFlash block draft, which has no such
    steps; docs/measurements.md, issue 28."""
    default = arch not in ("mla", "dflash")
    return (default if norm_before_residual is None else norm_before_residual,
            default if norm_output is None else norm_output)


def resolve_arch(arch: str, target_cfg, mla_dims: dict | None = None) -> str:
    """`auto` -> mla for a target with multi-head latent attention (DeepSeek-V3 / Kimi; measured
    better there than the Llama layer: docs/measurements.md, "04: the MLA head vs the Llama head";
    DFlash led it on the DeepSeek-V3 bench and trailed it on the Kimi twin, "The draft for the k
    users serve", in AL and in output tok/s modelled on the box, "Which draft serves faster"), else
    llama. MLA dims asked for a non-MLA draft are refused."""
    from eagle3_train.common.target import has_mla

    if arch == "auto":
        arch = "mla" if has_mla(text_config(target_cfg)) else "llama"
    if arch != "mla" and (asked := [f"--draft-{k.replace('_', '-')}" for k, v in (mla_dims or {}).items()
                                    if v is not None]):
        raise PipelineError(f"{', '.join(asked)} shape an MLA draft layer, but this draft is {arch} "
                            f"(the target has no MLA config, or --draft-arch {arch})")
    return arch


def layer_config(target_cfg, *, arch: str = "llama", hidden_size: int | None = None,
                 intermediate_size: int | None = None, num_layers: int = 1, num_heads: int | None = None,
                 num_kv_heads: int | None = None, head_dim: int | None = None, attn_impl: str = "sdpa",
                 window: int | None = None):
    """The draft decoder's config, shaped from the target: same width, heads and rope unless told
    otherwise; vocab = the target's (d2t/t2d restrict it). `window`: every layer attends to the last
    `window` positions, written as vLLM's Llama/Qwen3 eagle3 drafts read it (`layer_types[i]` of draft
    layer i == "sliding_attention" -> `sliding_window`), which speculators reads too."""
    from transformers import LlamaConfig
    from transformers.models.qwen3.configuration_qwen3 import Qwen3Config

    if arch not in DRAFT_LAYERS:
        raise PipelineError(f"--draft-arch must be one of {DRAFT_LAYERS}, not {arch!r}")
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
        if window:
            cfg.layer_types, cfg.sliding_window = ["sliding_attention"] * num_layers, int(window)
    elif window:
        cfg = Qwen3Config(**common, use_sliding_window=True, sliding_window=int(window),
                          layer_types=["sliding_attention"] * num_layers)
    else:
        cfg = Qwen3Config(**common, use_sliding_window=False, layer_types=["full_attention"] * num_layers)
    cfg._attn_implementation = attn_impl
    return cfg


def build_draft(target: str, target_cfg, *, aux_layer_ids: list[int], d2t: torch.Tensor | None,
                t2d: torch.Tensor | None, weights: dict | None, arch: str = "llama",
                hidden_size: int | None = None, intermediate_size: int | None = None, num_layers: int = 1,
                num_heads: int | None = None, num_kv_heads: int | None = None,
                norm_before_residual: bool = False, norm_before_fc: bool = False, norm_output: bool = False,
                speculative_tokens: int = 3,
                train_embeddings: bool = False, train_lm_head: bool = False, attn_impl: str = "sdpa",
                init_std: float = 0.02, seed: int = 0, mla_dims: dict | None = None, window: int | None = None):
    """A fresh draft for `target`. `weights` (from load_target_weights) seed embed_tokens and
    lm_head when the draft is as wide as the target; a narrower draft learns its own. `window`: the
    layers' attention window (layer_config; None: full attention)."""
    if arch == "mla":
        from eagle3_train.train.draft_mla import build_mla_draft

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
                      attn_impl=attn_impl, window=window)
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
    if rows_from_target(model, weights if wide else None, t2d, init_std):
        train_embeddings = train_lm_head = True
    # The training targets come from our own TargetHead; the model's copies are never used.
    model.verifier_lm_head = None
    model.verifier_norm = None
    model.embed_tokens.weight.requires_grad_(train_embeddings)
    model.lm_head.weight.requires_grad_(train_lm_head)
    model.config.embed_requires_grad = train_embeddings
    return model


# ----------------------------------------------------------------------------- export

def export_draft(model, out_dir: Path, *, extra: dict | None = None) -> Path:
    """Write the directory in speculators' eagle3 format (config.json + model.safetensors) atomically and
    check what vLLM relies on is in it (an MLA draft: vLLM's deepseek_eagle3 format, draft_mla.py)."""
    from safetensors import safe_open

    if getattr(model, "is_mla", False):
        from eagle3_train.train.draft_mla import export_mla

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
    layer = cfg.get("transformer_layer_config") or {}
    if (window := window_of(model)) and (layer.get("sliding_window") != window or set(layer.get("layer_types") or [])
                                          != {"sliding_attention"}):
        raise RuntimeError(f"export config.json's transformer_layer_config lacks the draft's window {window} "
                           f"(layer_types {layer.get('layer_types')}, sliding_window {layer.get('sliding_window')})")
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
