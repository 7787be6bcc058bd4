"""02's and 04's --dry-run: the planner's figures for that one stage, printed, nothing written
(reached by name through common/dry_run.py, so no stage imports plan/)."""

from __future__ import annotations

from eagle3_train.plan.draft import blocks
from eagle3_train.plan.planner import GB, Flags, Shape, plan


def _target_shape(name_or_path: str) -> Shape:
    from eagle3_train.common.target import target_info

    return Shape.from_config(target_info(name_or_path)[1])


def dry_run_extract(cfg) -> int:
    """02 --dry-run: its plan from the tokenized input's counts, the target's config and the flags."""
    from eagle3_train.extract.stage import InputSet, parse_layers

    inp, shape = InputSet.open(cfg.input), _target_shape(cfg.model)
    counts = inp.manifest.get("counts") or {}
    samples = int(counts.get("samples") or 1)
    f = Flags(samples=samples, tokens_per_sample=inp.tokens / samples, storage=cfg.storage, topk=cfg.topk,
              n_aux=len(parse_layers(cfg.layers, shape.layers)), shard_mb=cfg.shard_mb)
    s = plan(shape, f)["stages"]["02"]
    print(f"02 plan: {s['tokens']:,} tokens, store about {s['disk'] / GB:,.2f} GB ({cfg.storage}), "
          f"head on GPU {s['gpu_memory'] / GB:,.2f} GB, {s['hours']:.1f} h at {s['rate_tok_s']:,.0f} tok/s "
          f"({s['rate_source']}); nothing written")
    return 0


def dry_run_train(cfg) -> int:
    """04 --dry-run: its per-GPU memory, checkpoint and export from the store's and the mapping's
    manifests, the target's config and the flags."""
    from pathlib import Path

    from eagle3_train.common.manifest import read_manifest
    from eagle3_train.train.budget import choose_lr

    store, mapping = read_manifest(Path(cfg.hidden_states)) or {}, read_manifest(Path(cfg.vocab_mapping)) or {}
    shape, counts = _target_shape(cfg.target), store.get("counts") or {}
    samples = int(counts.get("samples") or 1)
    f = Flags(samples=samples, tokens_per_sample=int(counts.get("tokens") or 0) / samples,
              storage=(store.get("storage") or {}).get("format", "bf16"),
              n_aux=cfg.draft_layers if cfg.per_draft_layer else
              len(cfg.aux_layer_ids or store.get("aux_layer_ids") or [0, 0, 0]), draft_layers=cfg.draft_layers,
              draft_vocab_size=int((mapping.get("counts") or {}).get("draft_vocab_size") or shape.vocab),
              max_tokens_per_batch=cfg.max_tokens_per_batch, ttt_steps=cfg.ttt_steps, epochs=cfg.epochs,
              optimizer=cfg.optimizer, draft_arch=cfg.draft_arch, norm_before_fc=cfg.norm_before_fc,
              train_embeddings=cfg.train_embeddings, train_lm_head=cfg.train_lm_head,
              num_speculative_tokens=cfg.num_speculative_tokens, block_size=cfg.block_size,
              block_anchors=cfg.block_anchors, attn="flex" if cfg.attn in ("auto", "flex") else cfg.attn)
    s = plan(shape, f)["stages"]["04"]
    lr = choose_lr(cfg.lr, cfg.draft_width(shape.hidden))
    steps = (f"blocks of {blocks(f)} (sdpa)" if s["draft"] == "dflash" else
             f"{cfg.ttt_steps} TTT steps (bf16, flex on CUDA)")
    print(f"04 plan: {s['draft']} draft{'' if s['draft'] == 'dflash' else ' layer'}, lr {lr['lr']:g} "
          f"({lr['lr_why']}); per GPU {s['gpu_memory'] / GB:,.2f} GB at {cfg.max_tokens_per_batch} tokens x {steps}; "
          f"checkpoint {s['checkpoint'] / GB:,.2f} GB, "
          f"export {s['export_bf16'] / GB:,.2f} GB bf16 / {s['export_fp32'] / GB:,.2f} GB fp32; nothing written")
    return 0
