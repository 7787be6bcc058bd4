"""What 04 trains: the draft (made from the config in one place), the target's frozen head that
gives the targets, and the objective around the draft as the processes share it."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from eagle3_train.common.config import require
from eagle3_train.train import draft as D
from eagle3_train.train import draft_core as core
from eagle3_train.train.config import MLA_WINDOW, TrainConfig
from eagle3_train.train.dist import Dist, wrap
from eagle3_train.train.inputs import Inputs
from eagle3_train.train.objective import Objective

ATTN_IMPL = {"flex": "simple_flex_attention", "sdpa": "sdpa", "eager": "eager"}


def draft_arch(config: TrainConfig, inp: Inputs) -> str:
    """The draft's layer style for this target (auto resolved), its shape checked: called before
    anything is written, so a draft the target cannot have is refused in one line."""
    dims = mla_dims(config)
    arch = D.resolve_arch(config.draft_arch, inp.target_cfg, dims)
    require(arch != "mla" or config.window_for(arch) is None, MLA_WINDOW)  # auto resolved to the MLA layer
    if arch == "mla":
        from eagle3_train.train.draft_mla import mla_layer_config

        mla_layer_config(inp.target_cfg, num_layers=config.draft_layers, dims=dims, target_name=str(inp.target))
    return arch


def mla_dims(config: TrainConfig) -> dict:
    return {k.removeprefix("draft_"): v for k, v in config.mla_dims.items()}


def make_draft(config: TrainConfig, inp: Inputs, weights: dict, attn: str = "sdpa"):
    """A fresh draft for the target, shaped by the config (weights: core.load_target_weights)."""
    arch = draft_arch(config, inp)
    if arch == "dflash":  # a block drafter, not an EAGLE-3 layer
        from eagle3_train.train.draft_dflash import make_dflash_draft

        return make_dflash_draft(config, inp, weights, ATTN_IMPL[attn])
    dims = mla_dims(config)
    norm_before_residual, norm_output = D.step_norms(arch, config.norm_before_residual, config.norm_output)
    return D.build_draft(inp.target, inp.target_cfg, aux_layer_ids=inp.aux_ids,
                         d2t=torch.from_numpy(inp.mapping.d2t).long(), t2d=torch.from_numpy(inp.mapping.t2d).bool(),
                         weights=weights, arch=arch, hidden_size=config.draft_hidden_size,
                         intermediate_size=config.draft_intermediate_size, num_layers=config.draft_layers,
                         num_heads=config.draft_heads, num_kv_heads=config.draft_kv_heads,
                         norm_before_residual=norm_before_residual, norm_before_fc=config.norm_before_fc,
                         norm_output=norm_output,
                         speculative_tokens=config.spec_tokens,
                         train_embeddings=config.train_embeddings, train_lm_head=config.train_lm_head,
                         attn_impl=ATTN_IMPL[attn], seed=config.seed,
                         mla_dims=dims, window=config.window_for(arch))


@dataclass
class TrainModel:
    draft: nn.Module  # speculators' Eagle3DraftModel
    head: core.TargetHead | None  # the target's norm + lm_head (None: the store keeps top-k targets)
    objective: Objective  # the draft + its loss, what is checkpointed
    wrapped: nn.Module  # the objective as the processes run it (itself, DDP or FSDP)
    kernels: dict  # {"attn": ..., "loss_impl": ...} as resolved for this device
    to_target: object  # draft-vocab ids -> target-vocab ids

    def __post_init__(self):
        # After wrapping: FSDP replaces the parameters with sharded ones.
        self.parameters = [p for p in self.objective.parameters() if p.requires_grad]

    def sync(self, last: bool):
        """DDP all-reduces gradients on a step's last micro-batch only."""
        return contextlib.nullcontext() if last or not hasattr(self.wrapped, "no_sync") else self.wrapped.no_sync()


def build_model(config: TrainConfig, inp: Inputs, d: Dist) -> TrainModel:
    kernels = config.kernels(d.cuda)
    weights = core.load_target_weights(inp.target)
    draft = make_draft(config, inp, weights, kernels["attn"])
    if kernels["attn"] == "flex":
        if getattr(draft, "_attn_impl", None) == ATTN_IMPL["flex"]:
            from eagle3_train.train import flex

            # blocks that fit this GPU's shared memory, checked by one small compiled step (flex.py)
            kernels["flex_options"] = flex.setup(draft, d.device, d.dtype, main=d.main)
        else:
            core.use_compiled_flex()
    t2d = torch.from_numpy(inp.mapping.t2d).bool()
    draft_ids = t2d.nonzero().squeeze(1) if draft.use_draft_vocab else None
    head = None if inp.topk else core.target_head(inp.target_cfg, weights, draft_ids, d.device, d.dtype)
    tgt2draft = None
    if inp.topk and draft.use_draft_vocab:  # top-k ids are target ids: where each sits in the draft vocab
        tgt2draft = torch.full((t2d.shape[0],), -1, dtype=torch.long)
        tgt2draft[draft_ids] = torch.arange(draft_ids.shape[0])
    del weights
    if config.draft_arch == "dflash":
        from eagle3_train.train.objective_dflash import BlockObjective

        objective = BlockObjective(draft, config.blocks, config.block_gamma, config.block_anchors,
                                   kernels["loss_impl"], inp.topk, tgt2draft, loss=config.loss,
                                   serve=config.spec_tokens, block_loss=config.block_loss).to(d.device)
    else:
        objective = Objective(draft, config.ttt_steps, config.step_weights, kernels["loss_impl"], inp.topk,
                              tgt2draft, loss=config.loss).to(d.device)
    to_target = core.draft_to_target(draft)
    return TrainModel(draft, head, objective, wrap(objective, config.distributed, d), kernels, to_target)
