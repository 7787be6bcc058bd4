"""04's memory, part by part, against the planner's figure (planner.train_memory), measured as what
its tensors hold, not the process's RSS (torch and speculators alone are ~1 GB of it, which would
swamp a draft of a few MB): scripts/bench/train.py memory and tests/test_planner.py.

  weights        every parameter of the draft (frozen ones too)
  grads_and_adam the gradients + AdamW's two states after one step
  target_head    the frozen target head's buffers (norm, full lm_head, the draft-vocab rows) and
                 the batch's targets it computes
  activations    what autograd keeps for the backward during one full-size step (saved tensors,
                 each storage counted once, parameters and the batch's inputs excluded)
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

PARTS = ("weights", "grads_and_adam", "target_head", "activations", "total")


def nbytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def measure(trainer) -> dict:
    """The four parts of one step of `trainer` (its first batch of full size)."""
    from eagle3_train.train.objective import prepare

    model, d = trainer.model, trainer.d
    exclude = {p.untyped_storage().data_ptr() for p in model.objective.parameters()}
    exclude |= {b.untyped_storage().data_ptr() for b in model.objective.buffers()}
    saved: dict[int, int] = {}

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if key not in exclude:
            saved[key] = t.untyped_storage().nbytes()
        return t

    batches = trainer.loader.step(0)
    batch = max(batches, key=lambda b: int(b.ids.shape[1]))
    tokens = int(batch.ids.shape[1])  # S, padded: what the step's tensors are sized by
    # One forward over the batch, as the planner sizes it (flex on GPU; --group-tokens groups only
    # dense attention, and holds less)
    batch = prepare(batch.to(d.device, d.dtype), model.head, trainer.config.draft_steps)
    exclude |= {v.untyped_storage().data_ptr() for v in vars(batch).values() if isinstance(v, torch.Tensor)}
    for o in trainer.optimizers:
        o.zero_grad(set_to_none=True)
    model.objective.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), d.autocast():
        _, loss, _ = model.wrapped(batch)
    activations = sum(saved.values())
    loss.backward()
    for o in trainer.optimizers:
        o.step()
    states = [v for o in trainer.optimizers for s in o.state.values() for v in s.values()
              if isinstance(v, torch.Tensor) and v.dim() > 0]
    return {"weights": nbytes(model.objective.draft.parameters()),
            "grads_and_adam": nbytes(p.grad for p in model.parameters) + nbytes(states),
            # the head's buffers and the targets it made for this batch (the plan counts both there)
            "target_head": (nbytes(model.head.buffers()) if model.head is not None else 0) + nbytes([batch.targets]),
            "activations": activations, "tokens": tokens, "supervised": int(batch.rows[0].numel())}


def compare(cfg) -> tuple[dict, object]:
    """04's Trainer for `cfg` (a parsed 04 config) measured against planner.train_memory:
    {part: {planned, measured, ratio}} and the planner flags used."""
    from eagle3_train.plan import planner
    from eagle3_train.train.dist import setup_dist
    from eagle3_train.train.inputs import open_inputs
    from eagle3_train.train.loop import Trainer

    d = setup_dist(cfg.device)
    inp = open_inputs(cfg, d.dtype)
    trainer = Trainer(cfg, d, inp, Path(cfg.output_dir))
    got = measure(trainer)
    got["total"] = sum(got[k] for k in PARTS[:-1])
    shape = planner.Shape.from_config(json.loads((Path(cfg.target) / "config.json").read_text()))
    flags = planner.Flags(samples=len(inp.store.ids), tokens_per_sample=100,
                          storage="fp8-topk" if inp.topk else "fp32", n_aux=len(inp.aux_ids),
                          draft_vocab_size=int(inp.mapping.d2t.shape[0]), max_tokens_per_batch=got["tokens"],
                          ttt_steps=cfg.ttt_steps, attn=trainer.model.kernels["attn"],
                          act_bytes=2 if d.dtype in (torch.bfloat16, torch.float16) else 4,
                          train_lm_head=cfg.train_lm_head, train_embeddings=cfg.train_embeddings,
                          optimizer=cfg.optimizer, draft_arch=cfg.draft_arch,  # resolved by the Trainer
                          num_speculative_tokens=cfg.num_speculative_tokens, block_size=cfg.block_size,
                          block_anchors=cfg.block_anchors, supervised_fraction=got["supervised"] / got["tokens"],
                          draft_layers=cfg.draft_layers)
    plan = planner.train_memory(shape, flags)
    rows = {k: {"planned": plan[k], "measured": got[k], "ratio": plan[k] / got[k] if got[k] else None} for k in PARTS}
    return rows, flags
