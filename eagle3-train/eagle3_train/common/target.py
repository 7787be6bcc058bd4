"""The target model as the pipeline sees it before loading its weights: its config, checked.

02 reads its layer count and hidden size, 03/04/05 its vocabulary size (the embedding rows, which
may exceed the tokenizer's length in padded vocabularies). Multimodal wrappers (Kimi-K2.5) hold
the language model's config in `text_config`.
"""

from __future__ import annotations

from pathlib import Path

from eagle3_train.common.errors import PipelineError
from eagle3_train.common.manifest import describe_target, text_config

# multi-head latent attention (DeepSeek-V3 / Kimi): q_lora_rank may be 0 (no q compression)
MLA_DIMS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def has_mla(tc) -> bool:
    """Whether a text config (a transformers config or its dict) describes an MLA model."""
    get = tc.get if isinstance(tc, dict) else (lambda k: getattr(tc, k, None))
    return all(get(k) for k in MLA_DIMS[1:])


def load_target_config(name_or_path: str):
    """The target's config (transformers AutoConfig), or one PipelineError line saying why not."""
    from eagle3_train.common.target_layout import load_config

    try:
        config = load_config(name_or_path)
    except (OSError, ValueError) as e:
        raise PipelineError(f"cannot load the target config from {name_or_path!r}: "
                            f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    if not isinstance(getattr(text_config(config), "vocab_size", None), int):
        raise PipelineError(f"the target config of {name_or_path!r} has no vocab_size")
    return config


def target_info(name_or_path: str) -> tuple[dict, object]:
    """(describe_target for manifests, the language model's config)."""
    config = load_target_config(name_or_path)
    return describe_target(config, name_or_path), text_config(config)


def looks_like_hub_id(name: str | Path) -> bool:
    """`org/name` and nothing on this disk by that path: what the hub could hold."""
    text = str(name)
    return not Path(text).exists() and not text.startswith((".", "/", "~")) and text.count("/") == 1


def local_model_dir(name_or_path: str | Path, *, what: str = "--model") -> Path:
    """The folder holding a checkpoint's files: the path itself, or a hub id's complete copy in the
    local Hugging Face cache. Stages that read weight files directly (02's top-k head, 04's and 05's
    target head) need one; nothing is downloaded here, a 1T checkpoint is fetched on purpose."""
    path = Path(name_or_path)
    if path.is_dir():
        return path
    text = str(name_or_path)
    if not looks_like_hub_id(text):
        raise PipelineError(f"{what} {text}: no such folder (a local checkpoint folder or a hub id)")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(text, local_files_only=True))
    except (LocalEntryNotFoundError, OSError, ValueError):
        raise PipelineError(f"{what} {text}: a hub id with no local copy; download it first "
                            f"(`hf download {text}`) or pass its local folder") from None
