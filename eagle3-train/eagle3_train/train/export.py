"""04's last act: export the chosen checkpoint in the format vLLM serves (speculators'
eagle3 or DFlash format; vLLM's deepseek_eagle3 format for the MLA layer), draw the curves, write
the manifest (the run counts as finished only from then on)."""

from __future__ import annotations

import torch

from eagle3_train.common import positions
from eagle3_train.common.manifest import describe_target, write_manifest
from eagle3_train.train.config import EXPORT, METRICS, STAGE
from eagle3_train.train.draft import export_draft, resolve_arch
from eagle3_train.train.draft_core import load_target_weights
from eagle3_train.train.metrics import last_by_position, plot_curves, plot_positions, read_metrics
from eagle3_train.train.model import make_draft

EXPORT_TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def export(trainer, identity: dict) -> dict:
    """The best checkpoint by validation acceptance (or the last, --export-from last); every rank
    calls it, rank 0 writes and returns the manifest."""
    from eagle3_train.common.split import SPLIT

    config, d, plan, out, model = trainer.config, trainer.d, trainer.plan, trainer.out, trainer.model
    step, best = trainer.step, trainer.best
    pick = best["step"] if config.export_from == "best" and best["step"] else step
    valid = trainer.checkpointer.valid()
    if pick != step and pick in valid:
        trainer.checkpointer.load_weights(model.objective, pick)
    sharded = d.world > 1 and config.distributed == "fsdp"
    full = None
    if sharded:  # gathering the full state is a collective: every rank takes part
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(model.objective, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    result = {}
    if d.main:
        draft = unsharded_draft(trainer, full) if sharded else model.draft.to("cpu").float()
        info = {"step": pick, "best": best, "total_steps": trainer.total_steps, "recipe": trainer.length,
                **model.kernels,
                "args": config.to_dict()}
        # bf16 by default: a Kimi-size draft is ~9 GB in fp32, and vLLM casts to its dtype on load.
        write = export_draft
        if getattr(draft, "is_dflash", False):  # vLLM's method dflash, not eagle3
            from eagle3_train.train.draft_dflash import export_dflash as write
        write(draft.to(EXPORT_TORCH_DTYPES[config.export_dtype]), out / EXPORT, extra=info)
        curves = plot_curves(out, config.loss)
        by_pos = last_by_position(out)
        pos_plot = plot_positions(out)
        result = write_manifest(
            out, STAGE, config=config.to_dict(), inputs=identity,
            outputs={"export": str((out / EXPORT).resolve()), "checkpoint": str(valid.get(pick, "")),
                     "curves": str(curves) if curves else None, "metrics": str(out / METRICS),
                     "al_by_position": str(pos_plot) if pos_plot else None},
            counts={"steps": trainer.total_steps, "exported_step": pick, "train_samples": len(plan.train),
                    "val_samples": len(plan.val), "dropped_short": plan.dropped,
                    "cut_train_samples": plan.cut["train"]["samples"], "cut_val_samples": plan.cut["val"]["samples"]},
            cut=plan.cut, export_dtype=config.export_dtype,
            split={"rule": SPLIT.replace("heldout_fraction", "val_fraction"), "val_fraction": config.val_fraction,
                   "val_ids": sorted(plan.val)},
            recipe=trainer.length, best=best, final_val=(read_metrics(out).get("val") or [None])[-1],
            by_position=by_pos["by_position"] if by_pos else None,  # final_val's (its step), at --position-buckets
            target=describe_target(trainer.inp.target_cfg, config.target),
            tokenizer=trainer.inp.store.manifest.get("tokenizer"), layer_ids=trainer.inp.aux_ids,
            draft={"arch": resolve_arch(config.draft_arch, trainer.inp.target_cfg), "hidden_size": draft.config.transformer_layer_config.hidden_size,
                   "target_hidden_size": draft.config.target_hidden_size,
                   "draft_vocab_size": draft.config.draft_vocab_size})
        print(f"exported step {pick} to {out / EXPORT}"
              + (f" (validation AL {best['acceptance_length']:.3f} with {config.val_steps} draft tokens)"
                 if best["acceptance_length"] else ""))
        if by_pos:
            print(f"validation acceptance by position (step {by_pos['step']}, {config.val_steps} draft tokens):\n"
                  + positions.table(by_pos["by_position"]["rows"], config.val_steps), flush=True)
    d.barrier()
    return result


def unsharded_draft(trainer, full_state: dict):
    """Under FSDP the live draft is sharded; rank 0 makes a plain one from the full state."""
    draft = make_draft(trainer.config, trainer.inp, load_target_weights(trainer.inp.target))
    draft.load_state_dict({k.removeprefix("draft."): v for k, v in full_state.items() if k.startswith("draft.")},
                          strict=False)
    return draft.float()
