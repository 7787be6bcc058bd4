"""The MLA draft (`04 --draft-arch mla`): an EAGLE-3 draft whose decoder layer is the DeepSeek-V3 /
Kimi target's own architecture, multi-head latent attention + a dense MLP, as vLLM 0.32 serves it
(`vllm/model_executor/models/deepseek_eagle3.py`, `Eagle3DeepseekV2ForCausalLM` = `...V3...`).

speculators 0.9.0 builds only Llama/Qwen3 draft layers, so this is our own module, made of
transformers' DeepSeek-V3 pieces (`DeepseekV3Attention`, `DeepseekV3MLP`, `DeepseekV3RMSNorm`,
`DeepseekV3RotaryEmbedding`) with the EAGLE-3 first-layer change: the latent projections
(`q_a_proj`, `kv_a_proj_with_mqa`, or `q_proj` without a q LoRA) take `[embeds, hidden]`, 2x the
width. `MlaDraft` carries the attributes `draft.unroll` / `head` / the objective use on speculators'
`Eagle3DraftModel` (embed_tokens, fc, layers, rotary_emb, norm, lm_head, d2t/t2d, config.norm_output),
so the TTT unroll, loss and loop are the Llama path's, unchanged: each TTT step writes its MLA latents
(`kv_nope`, `k_rot`) into the same growing cache and attends under the same extended mask.

The export is vLLM's deepseek_eagle3 format, not speculators' (vLLM's speculators reader maps only
llama/qwen3 layers, vllm/transformers_utils/configs/speculators/algos.py): it is a plain DeepSeek-V3 config with
`architectures: ["Eagle3DeepseekV2ForCausalLM"]` (model_type deepseek_v2, see MODEL_TYPE), which vLLM
wraps in its EAGLEConfig, plus the EAGLE-3 keys that file reads, written explicitly. Our own metadata (k, the verifier) sits under
`eagle3_train`, never `speculators_config` (that key makes vLLM read the file as speculators').
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from eagle3_train.common.errors import PipelineError
from eagle3_train.common.manifest import text_config
from eagle3_train.common.store import TMP_PREFIX, atomic_dir_commit
from eagle3_train.common.target import MLA_DIMS, has_mla

ARCHITECTURE = "Eagle3DeepseekV2ForCausalLM"
# Not deepseek_v3: vLLM turns every deepseek_v3 draft config into its MTP model
# (vllm/config/speculative.py:679, hf_config_override: model_type -> deepseek_mtp, then
# "Eagle3DeepSeekMTPModel ... not supported"). Same fields; our loader reads them as DeepSeek-V3's.
MODEL_TYPE = "deepseek_v2"
META = "eagle3_train"


def is_mla_export(cfg: dict) -> bool:
    return any(a.startswith("Eagle3Deepseek") for a in cfg.get("architectures") or [])


def mla_layer_config(target_cfg, *, hidden_size: int | None = None, intermediate_size: int | None = None,
                     num_layers: int = 1, num_heads: int | None = None, dims: dict | None = None,
                     attn_impl: str = "sdpa", target_name: str = "the target"):
    """The draft layer's DeepSeek-V3 config: the target's MLA dims, heads, rope (YaRN included) and
    norms unless `dims` / the arguments say otherwise; dense MLP (no MoE); vocab = the target's."""
    from transformers import DeepseekV3Config

    tc = text_config(target_cfg)
    if not has_mla(tc):
        raise PipelineError(f"--draft-arch mla needs a target with multi-head latent attention (a DeepSeek-V3 / "
                            f"Kimi config with {', '.join(MLA_DIMS[1:])}); {target_name} is "
                            f"model_type {getattr(tc, 'model_type', '?')!r} without them: use --draft-arch llama")
    if num_layers != 1:
        raise PipelineError(f"--draft-arch mla builds one decoder layer (vLLM's deepseek_eagle3 first layer), "
                            f"not --draft-layers {num_layers}")
    mla = {k: getattr(tc, k, None) for k in MLA_DIMS}
    mla.update({k: v for k, v in (dims or {}).items() if v is not None})
    hidden = int(hidden_size or tc.hidden_size)
    heads = int(num_heads or tc.num_attention_heads)
    if intermediate_size is None:  # the target's dense MLP width (DeepSeek-V3's first layers), scaled
        intermediate_size = int(tc.intermediate_size * hidden / tc.hidden_size)
    rope = dict(getattr(tc, "rope_parameters", None) or {"rope_type": "default",
                                                         "rope_theta": getattr(tc, "rope_theta", 10000.0)})
    cfg = DeepseekV3Config(
        vocab_size=tc.vocab_size, hidden_size=hidden, intermediate_size=int(intermediate_size),
        num_hidden_layers=num_layers, num_attention_heads=heads, num_key_value_heads=heads,
        hidden_act=getattr(tc, "hidden_act", "silu"), rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-6),
        max_position_embeddings=getattr(tc, "max_position_embeddings", 4096), rope_parameters=rope,
        rope_interleave=getattr(tc, "rope_interleave", True), attention_bias=False, tie_word_embeddings=False,
        first_k_dense_replace=num_layers, pad_token_id=None, **mla)
    cfg._attn_implementation = attn_impl
    return cfg


class MlaFirstLayer(nn.Module):
    """DeepSeek-V3's decoder layer with a dense MLP and vLLM's EAGLE-3 first-layer input: the token
    embeddings and the fused hidden state, each normalised (input_layernorm, hidden_norm), then
    concatenated into the attention; the residual is the hidden part (normalised with
    norm_before_residual), as speculators' Llama first layer and vLLM's DeepseekV2Eagle3DecoderLayer."""

    def __init__(self, cfg, layer_idx: int = 0, norm_before_residual: bool = False):
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
            DeepseekV3Attention,
            DeepseekV3MLP,
            DeepseekV3RMSNorm,
        )

        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        attn = DeepseekV3Attention(cfg, layer_idx)
        wide = 2 * h
        if cfg.q_lora_rank:
            attn.q_a_proj = nn.Linear(wide, cfg.q_lora_rank, bias=False)
            attn.q_a_layernorm.variance_epsilon = eps  # vLLM's latent norms use the config's eps
        else:
            attn.q_proj = nn.Linear(wide, cfg.num_attention_heads * attn.qk_head_dim, bias=False)
        attn.kv_a_proj_with_mqa = nn.Linear(wide, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False)
        attn.kv_a_layernorm.variance_epsilon = eps
        self.self_attn = attn
        self.mlp = DeepseekV3MLP(cfg)
        self.input_layernorm = DeepseekV3RMSNorm(h, eps=eps)
        self.post_attention_layernorm = DeepseekV3RMSNorm(h, eps=eps)
        self.hidden_norm = DeepseekV3RMSNorm(h, eps=eps)
        self.norm_before_residual = norm_before_residual

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None,
                cache_position=None, position_embeddings=None, **kwargs):
        embeds, hidden = hidden_states.split(hidden_states.shape[-1] // 2, dim=-1)
        embeds = self.input_layernorm(embeds)
        residual = hidden
        hidden = self.hidden_norm(hidden)
        if self.norm_before_residual:
            residual = hidden
        out, _ = self.self_attn(torch.cat([embeds, hidden], dim=-1), position_embeddings=position_embeddings,
                                attention_mask=attention_mask, past_key_values=past_key_values,
                                cache_position=cache_position)
        hidden = residual + out
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class MlaDraftConfig:
    """What the pipeline reads from a draft's `config` (the speculators config's fields it uses)."""

    def __init__(self, layer, *, draft_vocab_size: int, target_hidden_size: int, aux_layer_ids: list[int],
                 norm_before_residual: bool, speculative_tokens: int, verifier: str, embed_requires_grad: bool,
                 fc_norm: bool = False, norm_output: bool = False):
        self.transformer_layer_config = layer
        self.draft_vocab_size = int(draft_vocab_size)
        self.target_hidden_size = int(target_hidden_size)
        self.eagle_aux_hidden_state_layer_ids = list(aux_layer_ids)
        self.norm_before_residual = bool(norm_before_residual)
        self.norm_output = bool(norm_output)
        # vLLM's deepseek_eagle3 offers one normalisation before fc: an RMSNorm per aux layer's chunk
        # (`fc_norm`), not the Llama draft's single norm over the concatenation (`norm_before_fc`).
        self.fc_norm = bool(fc_norm)
        self.speculative_tokens = int(speculative_tokens)
        self.verifier = str(verifier)
        self.embed_requires_grad = embed_requires_grad

    def export_dict(self, dtype: torch.dtype) -> dict:
        """config.json as vLLM's Eagle3DeepseekV2ForCausalLM reads it, every key it reads written."""
        lc = self.transformer_layer_config
        rope = dict(lc.rope_parameters)
        n_aux = len(self.eagle_aux_hidden_state_layer_ids)
        return {
            "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE,
            "hidden_size": lc.hidden_size, "intermediate_size": lc.intermediate_size,
            "num_hidden_layers": lc.num_hidden_layers, "num_attention_heads": lc.num_attention_heads,
            "num_key_value_heads": lc.num_key_value_heads, "hidden_act": lc.hidden_act,
            **{k: getattr(lc, k) for k in MLA_DIMS}, "rope_interleave": bool(lc.rope_interleave),
            "rms_norm_eps": lc.rms_norm_eps, "max_position_embeddings": lc.max_position_embeddings,
            # Legacy rope keys, as Kimi's own config.json: vLLM and transformers both read them.
            "rope_theta": rope.pop("rope_theta"), "rope_scaling": {"type": rope.pop("rope_type"), **rope},
            "vocab_size": lc.vocab_size, "tie_word_embeddings": False, "attention_bias": False,
            "first_k_dense_replace": lc.num_hidden_layers,
            # EAGLE-3 (deepseek_eagle3.py): fc input = target_hidden_size * num_aux_hidden_states,
            # lm_head rows = draft_vocab_size with d2t; the runner gathers eagle_aux_hidden_state_layer_ids.
            "draft_vocab_size": self.draft_vocab_size, "target_hidden_size": self.target_hidden_size,
            "num_aux_hidden_states": n_aux,
            "eagle_aux_hidden_state_layer_ids": self.eagle_aux_hidden_state_layer_ids,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": self.eagle_aux_hidden_state_layer_ids},
            "norm_before_residual": self.norm_before_residual, "norm_output": self.norm_output,
            "fc_norm": self.fc_norm,
            "dtype": str(dtype).removeprefix("torch."),
            META: {"draft_arch": "mla", "speculative_tokens": self.speculative_tokens, "verifier": self.verifier},
        }


class MlaDraft(nn.Module):
    """The one-layer MLA EAGLE-3 draft (see the module docstring)."""

    is_mla = True

    def __init__(self, config: MlaDraftConfig, vocab_size: int):
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm, DeepseekV3RotaryEmbedding

        super().__init__()
        lc = config.transformer_layer_config
        self.config = config
        self._attn_impl = lc._attn_implementation
        h = lc.hidden_size
        n_aux = len(config.eagle_aux_hidden_state_layer_ids)
        self.embed_tokens = nn.Embedding(vocab_size, h)
        self.fc = nn.Linear(n_aux * config.target_hidden_size, h, bias=False)
        self.layers = nn.ModuleList([MlaFirstLayer(lc, 0, config.norm_before_residual)])
        self.rotary_emb = DeepseekV3RotaryEmbedding(lc)
        self.norm = DeepseekV3RMSNorm(h, eps=lc.rms_norm_eps)
        self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
        self.input_norm = None  # the Llama draft's norm_before_fc; this layer's is fc_norm
        self.fc_norm = nn.ModuleList([DeepseekV3RMSNorm(config.target_hidden_size, eps=lc.rms_norm_eps)
                                      for _ in range(n_aux)]) if config.fc_norm else None
        self.verifier_vocab_size = vocab_size
        self.use_draft_vocab = config.draft_vocab_size != vocab_size
        if self.use_draft_vocab:
            self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(vocab_size, dtype=torch.bool))
        else:
            self.d2t = self.t2d = None

    def load_vocab_mappings(self, t2d: torch.Tensor, d2t: torch.Tensor) -> None:
        if t2d.shape[0] != self.verifier_vocab_size or d2t.shape[0] != self.config.draft_vocab_size:
            raise ValueError(f"vocab mapping shapes t2d {tuple(t2d.shape)}, d2t {tuple(d2t.shape)} do not fit "
                             f"vocab {self.verifier_vocab_size} / draft vocab {self.config.draft_vocab_size}")
        self.t2d.copy_(t2d.bool())
        self.d2t.copy_(d2t.long())

    def forward(self, hidden_states, input_ids, document_ids, position_ids, ttt_steps: int = 3, **_):
        """speculators' inference call (what 05's offline walk uses): the greedy draft-vocab token
        of each TTT step [1, S], teacher-forced, through the same unroll as training."""
        from eagle3_train.train.draft_core import unroll

        return [lg.argmax(-1) for lg in unroll(self, hidden_states, input_ids, position_ids,
                                              document_ids.squeeze(0), ttt_steps)]

    def _build_attn_mask(self, doc_ids, seq_len, device):
        """The non-sdpa masks as speculators' Eagle3DraftModel builds them from its mask_mod: a flex
        block mask (CUDA) or, for eager attention, a float mask."""
        from speculators.models.attention import create_float_mask
        from speculators.models.eagle3.attention import create_combined_mask_mod
        from torch.nn.attention.flex_attention import create_block_mask

        make = create_block_mask if self._attn_impl == "simple_flex_attention" else create_float_mask
        return make(create_combined_mask_mod(doc_ids, seq_len), B=None, H=None, Q_LEN=seq_len, KV_LEN=seq_len,
                    device=device)


def build_mla_draft(target, target_cfg, *, aux_layer_ids, d2t, t2d, weights, hidden_size=None,
                    intermediate_size=None, num_layers=1, num_heads=None, dims=None,
                    norm_before_residual=False, fc_norm=False, norm_output=False, speculative_tokens=3,
                    train_embeddings=False,
                    train_lm_head=False, attn_impl="sdpa", init_std=0.02, seed=0) -> MlaDraft:
    """A fresh MLA draft for `target` (build_draft's contract: embed/lm_head from the target when
    as wide, frozen unless asked; a narrower draft learns its own)."""
    tc = text_config(target_cfg)
    lc = mla_layer_config(target_cfg, hidden_size=hidden_size, intermediate_size=intermediate_size,
                          num_layers=num_layers, num_heads=num_heads, dims=dims, attn_impl=attn_impl,
                          target_name=str(target))
    vocab = tc.vocab_size
    draft_vocab = vocab if d2t is None else int(d2t.shape[0])
    config = MlaDraftConfig(lc, draft_vocab_size=draft_vocab, target_hidden_size=tc.hidden_size,
                            aux_layer_ids=aux_layer_ids, norm_before_residual=norm_before_residual,
                            speculative_tokens=speculative_tokens, verifier=str(target),
                            embed_requires_grad=train_embeddings, fc_norm=fc_norm, norm_output=norm_output)
    torch.manual_seed(seed)
    model = MlaDraft(config, vocab)
    for m in model.modules():  # transformers' _init_weights convention for DeepSeek-V3
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=init_std)
    if model.use_draft_vocab:
        model.load_vocab_mappings(t2d, d2t)
    wide = lc.hidden_size == tc.hidden_size
    from eagle3_train.train.draft_core import copy_target_rows

    if not copy_target_rows(model, weights if wide else None, t2d):
        with torch.no_grad():
            nn.init.normal_(model.embed_tokens.weight, std=init_std)
        train_embeddings = train_lm_head = True
    model.embed_tokens.weight.requires_grad_(train_embeddings)
    model.lm_head.weight.requires_grad_(train_lm_head)
    config.embed_requires_grad = train_embeddings
    return model


# ----------------------------------------------------------------------------- export / load

def export_mla(model: MlaDraft, out_dir: Path, *, extra: dict | None = None) -> Path:
    """config.json + model.safetensors in the names vLLM's deepseek_eagle3 load_weights maps
    (`layers.0.self_attn.{q_a_proj,kv_a_proj_with_mqa}` -> its fused_qkv_a_proj, `mlp.{gate,up}_proj`
    -> gate_up_proj, `d2t` -> draft_id_to_target_id; `t2d` is skipped by it and kept for us), atomically."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    tmp = out_dir.parent / f"{TMP_PREFIX}{out_dir.name}"
    if tmp.exists():
        import shutil

        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    dtype = model.fc.weight.dtype
    need = {"fc.weight", "norm.weight", "lm_head.weight", "embed_tokens.weight",
            "layers.0.self_attn.kv_a_proj_with_mqa.weight", "layers.0.self_attn.kv_b_proj.weight",
            "layers.0.self_attn.o_proj.weight", "layers.0.hidden_norm.weight"}
    if model.use_draft_vocab:
        need |= {"d2t", "t2d"}
    if model.config.fc_norm:
        need |= {f"fc_norm.{i}.weight" for i in range(len(model.fc_norm))}
    if missing := need - set(state):
        raise RuntimeError(f"MLA export weights lack {sorted(missing)}")
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(model.config.export_dict(dtype), indent=2) + "\n")
    if extra:
        (tmp / "training_info.json").write_text(json.dumps(extra, indent=2, sort_keys=True, default=str) + "\n")
    atomic_dir_commit(tmp, out_dir)
    return out_dir


def layer_config_from_export(cfg: dict, attn_impl: str = "sdpa"):
    from transformers import DeepseekV3Config

    keep = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type", META, "eagle_config", "dtype")}
    lc = DeepseekV3Config(**keep)
    lc._attn_implementation = attn_impl
    return lc


def load_mla_draft(draft_dir: Path, target=None, *, attn_impl: str = "sdpa") -> MlaDraft:
    """An MLA export back as our module (fp32 as stored; the caller casts)."""
    from safetensors.torch import load_file

    draft_dir = Path(draft_dir)
    cfg = json.loads((draft_dir / "config.json").read_text())
    lc = layer_config_from_export(cfg, attn_impl)
    meta = cfg.get(META) or {}
    config = MlaDraftConfig(lc, draft_vocab_size=cfg["draft_vocab_size"], target_hidden_size=cfg["target_hidden_size"],
                            aux_layer_ids=cfg["eagle_aux_hidden_state_layer_ids"],
                            norm_before_residual=cfg.get("norm_before_residual", False),
                            speculative_tokens=meta.get("speculative_tokens", 3),
                            verifier=meta.get("verifier", ""), embed_requires_grad=False,
                            fc_norm=cfg.get("fc_norm", False), norm_output=cfg.get("norm_output", False))
    model = MlaDraft(config, cfg["vocab_size"])
    state = load_file(str(draft_dir / "model.safetensors"))
    if "embed_tokens.weight" not in state and target is not None:
        from eagle3_train.train.draft_core import load_target_weights

        state["embed_tokens.weight"] = load_target_weights(target)["embed"]
    missing, unexpected = model.load_state_dict({k: v.float() if v.is_floating_point() else v
                                                  for k, v in state.items()}, strict=False)
    if missing or unexpected:
        raise PipelineError(f"{draft_dir}: weights do not fit its config.json (missing {missing[:4]}, "
                            f"unexpected {list(unexpected)[:4]})")
    return model
