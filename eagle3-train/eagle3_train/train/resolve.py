"""04's draft as the run trains it: the flags left to a default (--draft-arch auto, K, the DFlash
block, --block-causal, --draft-window auto, the step norms) resolved against the target and the run
already recorded in the output directory, so a bare rerun resumes as it ran."""

from __future__ import annotations

from pathlib import Path

from eagle3_train.train.config import BATCH_ANCHORS, TrainConfig
from eagle3_train.train.draft import step_norms
from eagle3_train.train.model import draft_arch


def resolve_draft(config: TrainConfig, inp, out: Path) -> None:
    """--draft-arch auto, the step norms' None (by the layer), K and the DFlash block recorded as
    what they resolve to: the manifest says what ran, and a run recorded before those were resolved
    resumes as it ran (a recorded `auto` is what auto resolves to; a DFlash block recorded as None
    meant K + 1; a bare rerun keeps its recorded --block-causal and --draft-window; the norms resume where
    unchanged)."""
    from eagle3_train.common import rerun

    was = {} if config.overwrite else (rerun.read_record(out) or {}).get("config") or {}
    arch = draft_arch(config, inp)
    aliases = {"draft_arch": ("auto", arch)} if config.draft_arch == "auto" and was.get("draft_arch") == "auto" else {}
    if was.get("draft_arch") in (arch, config.draft_arch) and was.get("num_speculative_tokens"):
        if config.num_speculative_tokens is None and config.block_size is None:
            config.num_speculative_tokens = was["num_speculative_tokens"]  # the bare rerun resumes its K
        if arch == "dflash" and was.get("block_size", 0) is None and config.block_size is None:
            config.block_size = config.num_speculative_tokens + 1
            aliases["block_size"] = (None, config.block_size)
        if arch == "dflash" and was.get("block_anchors") == BATCH_ANCHORS and config.block_anchors is None:
            aliases["block_anchors"] = (BATCH_ANCHORS, None)  # recorded when the default was written as its count
        if arch == "dflash" and "block_causal" not in was and config.block_causal is None:
            config.block_causal = False  # recorded before the flag: its blocks trained non-causal
            aliases["block_causal"] = (None, False)
        elif arch == "dflash" and config.block_causal is None:
            config.block_causal = was["block_causal"]  # the bare rerun resumes its block, whatever the default
    if config.draft_window == "auto":  # a bare rerun keeps the window it recorded, whatever the default
        config.draft_window = was["draft_window"] if was.get("draft_arch") in (arch, config.draft_arch) \
            and "draft_window" in was else config.window_for(arch)
    if aliases:
        config.record_aliases = aliases
    config.draft_arch = arch
    config.check_block()  # auto's block flags, now that it is known whether the draft is a block draft
    if arch == "dflash":
        config.block_size = config.blocks
    config.num_speculative_tokens = config.spec_tokens
    if arch == "dflash":
        config.block_causal = config.causal_block
    config.norm_before_residual, config.norm_output = step_norms(arch, config.norm_before_residual,
                                                                 config.norm_output)
