"""05's view of the draft: 04's export (speculators' eagle3 or DFlash format, or
vLLM's deepseek_eagle3 format for an MLA draft), checked, identified, and loaded for
the offline simulation; the target's head that gives its greedy tokens."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from eagle3_train.common.errors import PipelineError
from eagle3_train.common.manifest import describe_file
from eagle3_train.common.rerun import RUN
from eagle3_train.common.store import json_sha256

RECOMMENDED = "recommended_k.json"  # 05 --k-sweep's recommended K, written beside the export


def read_draft_config(draft_dir: Path) -> dict:
    """The export's config.json, checked to be a speculators EAGLE-3 or DFlash draft, or an MLA
    draft in vLLM's deepseek_eagle3 format (draft_mla.py), seen through the speculators keys 05 reads."""
    path = Path(draft_dir) / "config.json"
    if not path.exists():
        raise PipelineError(f"{draft_dir} is not a draft export (no config.json); pass 04's export/ dir")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise PipelineError(f"{path} is not valid JSON ({e.msg})") from None
    from eagle3_train.train.draft_mla import META, is_mla_export

    if is_mla_export(cfg):
        meta = cfg.get(META) or {}
        return {**cfg, "transformer_layer_config": {"vocab_size": cfg.get("vocab_size"),
                                                    "hidden_size": cfg.get("hidden_size")},
                "speculators_config": {"proposal_methods": [{"speculative_tokens": meta.get("speculative_tokens")}],
                                       "verifier": {"name_or_path": meta.get("verifier")}}}
    if cfg.get("speculators_model_type") not in METHODS:
        raise PipelineError(f"{path} has speculators_model_type={cfg.get('speculators_model_type')!r}, "
                            "expected 'eagle3' or 'dflash' (an eagle3 or DFlash export of 04 in speculators' format)")
    return cfg


METHODS = ("eagle3", "dflash")  # speculators_model_type -> vLLM's `method` (the same names)


def draft_method(cfg: dict) -> str:
    """vLLM's speculative `method` for the draft (always passed: without it vLLM guesses from the
    directory name). An MLA draft is served as eagle3 (vLLM's deepseek_eagle3 architecture)."""
    return "dflash" if cfg.get("speculators_model_type") == "dflash" else "eagle3"


def max_k(cfg: dict) -> int | None:
    """The most tokens the draft drafts in vLLM: block_size - 1 for a block draft (its block holds
    the anchor and the mask slots it was trained on); None (no bound) for EAGLE-3."""
    if draft_method(cfg) != "dflash":
        return None
    try:
        return int(cfg["block_size"]) - 1
    except (KeyError, TypeError, ValueError):
        raise PipelineError("the dflash draft's config.json has no block_size") from None


def aux_layer_ids(cfg: dict) -> list[int] | None:
    """The target layers the draft reads (EAGLE-3 and DFlash spell the key differently)."""
    return cfg.get("eagle_aux_hidden_state_layer_ids") or cfg.get("aux_hidden_state_layer_ids")


def draft_k(cfg: dict) -> int:
    """Speculative tokens the draft was exported for (speculators_config.proposal_methods[0])."""
    try:
        return int(cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"])
    except (KeyError, IndexError, TypeError, ValueError):
        raise PipelineError("draft config.json has no speculators_config.proposal_methods[0]"
                            ".speculative_tokens; pass --num-speculative-tokens") from None


def draft_target(cfg: dict) -> str | None:
    return (cfg.get("speculators_config") or {}).get("verifier", {}).get("name_or_path")


def describe_draft(draft_dir: Path) -> dict:
    """Identity of an export: its files' hashes, plus 04's manifest where the export sits in a run."""
    draft_dir = Path(draft_dir)
    # .pt: a DFlash draft's mask_embedding.pt. Not RECOMMENDED: 05 --k-sweep writes it beside the
    # export, which stays the same draft.
    files = {p.name: describe_file(p) for p in sorted(draft_dir.iterdir())
             if p.is_file() and not p.name.startswith(".") and p.suffix in (".json", ".safetensors", ".pt")
             and p.name != RECOMMENDED}
    out = {"path": str(draft_dir.resolve()), "files": files,
           "sha256": json_sha256({n: f["sha256"] for n, f in files.items()})}
    for d in (draft_dir, draft_dir.parent):
        m = d / "manifest.json"
        if m.exists() and m != draft_dir / "config.json":
            try:
                man = json.loads(m.read_text())
            except json.JSONDecodeError:
                continue
            # Where 04's split is read from; the export's own files are what identify the draft.
            out["manifest"] = {"path": str(m.resolve()), "stage": man.get("stage")}
            break
    else:
        if (draft_dir.parent / RUN).exists():  # a 04 run directory: its export counts only once it finished
            raise PipelineError(f"{draft_dir} belongs to the 04 run {draft_dir.parent}, which did not finish "
                                "(no manifest.json); resume 04 with the same command, or copy the export "
                                "out of the run directory to evaluate it as it is")
    return out


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def load_draft(draft_dir: Path, target: Path, *, device: str = "cpu", dtype: str = "fp32"):
    """The export as speculators' Eagle3DraftModel, on `device` in `dtype`, with sdpa attention
    (flex attention needs a compile). Built from its config and loaded from its weights directly,
    so a draft narrower than the target (fc of n_aux * target_hidden, see draft.py) loads too;
    embed_tokens comes from the target when the export leaves it out (vLLM shares the target's)."""
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    from eagle3_train.common.target_layout import read_weights
    from eagle3_train.train.draft_core import load_target_weights
    from eagle3_train.train.draft_dflash import load_dflash_draft
    from eagle3_train.train.draft_mla import is_mla_export, load_mla_draft

    draft_dir = Path(draft_dir)
    cfg = read_draft_config(draft_dir)
    if is_mla_export(cfg):
        return load_mla_draft(draft_dir, target).to(device=device, dtype=DTYPES[dtype]).eval()
    if draft_method(cfg) == "dflash":  # block drafts: offline.py runs them through draft_dflash.block_draft_tokens
        return load_dflash_draft(draft_dir, target).to(device=device, dtype=DTYPES[dtype]).eval()
    config = Eagle3SpeculatorConfig.from_pretrained(str(draft_dir))
    config.transformer_layer_config._attn_implementation = "sdpa"
    state = read_weights(draft_dir)
    model = Eagle3DraftModel(config)
    fc = state.get("fc.weight")
    if fc is not None and fc.shape != model.fc.weight.shape:
        model.fc = torch.nn.Linear(fc.shape[1], fc.shape[0], bias=False)
    norm = state.get("input_norm.weight")  # norm_before_fc: over fc's input, as vLLM builds it
    if norm is not None and model.input_norm is not None and norm.shape != model.input_norm.weight.shape:
        model.input_norm = type(model.input_norm)(norm.shape[0], eps=config.transformer_layer_config.rms_norm_eps)
    if "embed_tokens.weight" not in state:
        state["embed_tokens.weight"] = load_target_weights(target)["embed"]
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not m.startswith("verifier_")]  # training-only copies
    if missing or unexpected:
        raise PipelineError(f"{draft_dir}: weights do not fit its config.json (missing {missing[:4]}, "
                            f"unexpected {list(unexpected)[:4]})")
    return model.to(device=device, dtype=DTYPES[dtype]).eval()


def load_target_head(target: Path, *, device: str = "cpu", dtype: str = "fp32"):
    """The target's final norm + lm_head (04's TargetHead): greedy tokens from stored last states."""
    from eagle3_train.common.target import load_target_config
    from eagle3_train.train.draft_core import load_target_weights, target_head

    return target_head(load_target_config(str(target)), load_target_weights(target), None, device, DTYPES[dtype])
