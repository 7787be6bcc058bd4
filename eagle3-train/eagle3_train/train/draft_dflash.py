"""The DFlash block draft (`--draft-arch dflash`), built on speculators 0.9.0's `DFlashDraftModel` /
`DFlashSpeculatorConfig`, and served by vLLM 0.32 as `method: dflash` (qwen3_dflash.py).

What it is: a Qwen3-style stack that drafts a whole block in one forward. The block's queries are
the anchor token (the target's last accepted token, vLLM's bonus token) and block - 1 mask tokens at
the positions after it; they attend to each other (all of them, or with --block-causal each to the
ones before it) and to the context, whose
keys/values are `hidden_norm(fc(concatenated aux states))` of every earlier token. Slot i >= 1 of a
block anchored at token p drafts token p + i.

- `build_dflash_draft` / `make_dflash_draft`: a fresh draft for a target (width, heads and rope from
  draft.py's `layer_config`, the target's embed/lm_head rows from draft_core.py's `rows_from_target`).
- `run_blocks`: the block forward over a packed batch (the context, the anchors' blocks) as vLLM
  computes it: the training objective (objective_dflash.py) and validation call it;
  `block_draft_tokens`: the greedy proposals of a block of k + 1 at every position, for 05's walk.
- `load_dflash_draft`: an export loaded back (05's offline part).
- `export_dflash`: the directory in speculators' DFlash format vLLM loads.

Where speculators 0.9.0 stops or differs from what vLLM 0.32 serves:
- its `fc` is sized `n_aux * draft_hidden`; vLLM sizes it `n_aux * target_hidden_size`, so a draft
  narrower than the target gets `fc` rebuilt (as draft.py does for EAGLE-3);
- vLLM turns `sliding_window_non_causal: false` (speculators' default) into `causal: true` for every
  layer (transformers_utils/configs/speculators/algos.py:update_dflash), while speculators trains full
  attention non-causally; the export writes it as the block trained (`true` for a non-causal block) and
  `is_causal`, which vLLM reads first, so vLLM attends inside the block as trained;
- the mask slots' input: vLLM embeds `mask_token_id` with `embed_tokens` unless the export ships a
  `mask_embedding.pt` (qwen3_dflash.py:_read_mask_embedding). embed_tokens stays the target's frozen
  copy here, so the mask embedding is a trained vector of its own (`mask_embedding`), shipped so.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from eagle3_train.common.manifest import text_config
from eagle3_train.common.store import TMP_PREFIX, atomic_dir_commit

MASK_FILE = "mask_embedding.pt"  # vLLM reads it from the draft's directory


def build_dflash_draft(target: str, target_cfg, *, aux_layer_ids: list[int], d2t: torch.Tensor | None,
                       t2d: torch.Tensor | None, weights: dict | None, block_size: int,
                       mask_token_id: int | None = None, hidden_size: int | None = None,
                       intermediate_size: int | None = None, num_layers: int = 1, num_heads: int | None = None,
                       num_kv_heads: int | None = None, speculative_tokens: int | None = None,
                       train_embeddings: bool = False, train_lm_head: bool = False, attn_impl: str = "sdpa",
                       init_std: float = 0.02, seed: int = 0, causal: bool = False, window: int | None = None):
    """A fresh DFlash draft for `target`: `num_layers` Qwen3 layers, blocks of `block_size` (`causal`:
    each slot sees the slots before it only; `window`: every layer sees the last `window` positions,
    written as vLLM reads it: `layer_types` sliding_attention + `sliding_window`), the mask slots fed
    `mask_token_id` (default: the target's last vocab id) and a trained mask embedding."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    from eagle3_train.train.draft import layer_config
    from eagle3_train.train.draft_core import rows_from_target

    tc = text_config(target_cfg)
    # Dense masks only: a DFlash block mask is no EAGLE-3 one, and speculators' flex path for it
    # compiles a mask builder of its own (a CUDA-only follow-up).
    lc = layer_config(target_cfg, arch="qwen3", hidden_size=hidden_size, intermediate_size=intermediate_size,
                      num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads,
                      attn_impl="eager" if attn_impl == "eager" else "sdpa", window=window)
    # vLLM's per-layer causality reads `is_causal` first (qwen3_dflash.py:_dflash_layer_causal); the
    # `causal` its speculators loader derives from sliding_window_non_causal is set to agree
    lc.is_causal = bool(causal)
    vocab = tc.vocab_size
    draft_vocab = vocab if d2t is None else int(d2t.shape[0])
    mask_id = vocab - 1 if mask_token_id is None else int(mask_token_id)
    config = DFlashSpeculatorConfig(
        transformer_layer_config=lc, draft_vocab_size=draft_vocab, block_size=block_size,
        target_hidden_size=tc.hidden_size, aux_hidden_state_layer_ids=list(aux_layer_ids), mask_token_id=mask_id,
        sliding_window_non_causal=not causal, sample_from_anchor=False,
        speculators_config=SpeculatorsConfig(
            algorithm="dflash",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=speculative_tokens or block_size - 1)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=str(target),
                                    architectures=list(getattr(target_cfg, "architectures", None) or [])),
        ),
    )
    torch.manual_seed(seed)
    model = DFlashDraftModel(config)
    model.is_dflash = True
    model.block_causal = bool(causal)
    model.draft_window = int(window) if window else None
    wide = lc.hidden_size == tc.hidden_size
    if not wide:
        model.fc = nn.Linear(len(aux_layer_ids) * tc.hidden_size, lc.hidden_size, bias=False)
        nn.init.normal_(model.fc.weight, std=init_std)
    if d2t is not None and draft_vocab != vocab:
        model.load_vocab_mappings(t2d.bool(), d2t.long())
    if rows_from_target(model, weights if wide else None, t2d, init_std):
        train_embeddings = train_lm_head = True
    # Scaled like the token embeddings the other slots carry, so the first layer's norms see alike inputs.
    scale = float(model.embed_tokens.weight.float().std())
    model.mask_embedding = nn.Parameter(torch.randn(lc.hidden_size) * scale)
    # The training targets come from our own TargetHead; the model's copies are never used.
    model.verifier_lm_head = None
    model.verifier_norm = None
    model.embed_tokens.weight.requires_grad_(train_embeddings)
    model.lm_head.weight.requires_grad_(train_lm_head)
    # vLLM shares the target's embed_tokens when the export has none: ship it only when it is the draft's own.
    ignore = [k for k in model._keys_to_ignore_on_save if not (train_embeddings and k == "embed_tokens.weight")]
    model.__dict__["_keys_to_ignore_on_save"] = [*ignore, "mask_embedding"]
    return model


def make_dflash_draft(config, inp, weights: dict | None, attn_impl: str = "sdpa"):
    """build_dflash_draft from 04's config and inputs (train/model.py:make_draft dispatches here)."""
    return build_dflash_draft(
        inp.target, inp.target_cfg, aux_layer_ids=inp.aux_ids, d2t=torch.from_numpy(inp.mapping.d2t).long(),
        t2d=torch.from_numpy(inp.mapping.t2d).bool(), weights=weights, block_size=config.blocks,
        mask_token_id=config.mask_token_id, hidden_size=config.draft_hidden_size,
        intermediate_size=config.draft_intermediate_size, num_layers=config.draft_layers,
        num_heads=config.draft_heads, num_kv_heads=config.draft_kv_heads,
        speculative_tokens=config.spec_tokens, train_embeddings=config.train_embeddings,
        train_lm_head=config.train_lm_head, attn_impl=attn_impl, seed=config.seed, causal=config.causal_block,
        window=config.window_for("dflash"))


# ----------------------------------------------------------------------------- the block forward

def block_mask(doc: torch.Tensor, anchors: torch.Tensor, block: int, causal: bool = False,
               window: int | None = None, pos: torch.Tensor | None = None) -> torch.Tensor:
    """bool [1, 1, n*block, L + n*block]: block j's queries see the context rows 0..anchors[j] of
    their document (row i holds the aux state of the token before input i, so row anchors[j] is the
    anchor token's predecessor: what vLLM's context holds when it drafts after the anchor) and every
    query of their own block (`causal`: the queries up to their own only); nothing of other blocks.
    `window` (with `pos` [L], the input tokens' positions): a query at position p sees only the keys
    at p - window + 1 .. p (vLLM's sliding window; context row i sits at pos[i] - 1)."""
    n, length = anchors.numel(), doc.shape[0]
    q_anchor = anchors.repeat_interleave(block)
    kv = torch.arange(length, device=doc.device)
    ctx = (doc[None, :] == doc[q_anchor][:, None]) & (doc[None, :] >= 0) & (kv[None, :] <= q_anchor[:, None])
    blk = torch.arange(n, device=doc.device).repeat_interleave(block)
    own = blk[:, None] == blk[None, :]
    if causal:
        slot = torch.arange(n * block, device=doc.device)
        own &= slot[None, :] <= slot[:, None]
    if window:
        q_pos = pos[q_anchor] + torch.arange(block, device=doc.device).repeat(n)
        ctx &= (q_pos[:, None] - (pos[None, :] - 1)) < window
        own &= (q_pos[:, None] - q_pos[None, :]).abs() < window
    return torch.cat([ctx, own], dim=1)[None, None]


def run_blocks(model, aux: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor, doc: torch.Tensor,
               anchors: torch.Tensor, block: int | None = None) -> torch.Tensor:
    """The final-normed states [n, block, H] of the blocks anchored at `anchors` (indices into one
    packed stretch: aux [1, L, n_aux*H_target], ids / pos [1, L], doc [L]). Anchor j's block is the
    token ids[anchors[j]] then block - 1 mask slots, at positions pos[anchors[j]] + 0..block-1; the
    context row i sits at pos[i] - 1 (its token's own position, as vLLM's context positions).
    `block` (default: the trained one) is what vLLM runs at num_speculative_tokens K: K + 1 queries;
    the draft's `block_causal` (its export's is_causal) says whether a slot sees later slots."""
    block = block or model.block_size
    ctx = model.hidden_norm(model.fc(aux))
    n = anchors.numel()
    with torch.set_grad_enabled(torch.is_grad_enabled() and model.embed_tokens.weight.requires_grad):
        first = model.embed_tokens(ids[0, anchors])
    q = torch.cat([first[:, None], model.mask_embedding.to(first.dtype).expand(n, block - 1, -1)], dim=1)
    q_pos = pos[0, anchors][:, None] + torch.arange(block, device=pos.device)
    positions = torch.cat([pos[0] - 1, q_pos.reshape(-1)])[None]
    rope = model.rotary_emb(ctx, positions)
    mask = block_mask(doc, anchors, block, causal=getattr(model, "block_causal", False),
                      window=getattr(model, "draft_window", None), pos=pos[0])
    hidden = q.reshape(1, n * block, -1)
    for layer in model.layers:
        hidden = layer(target_hidden=ctx, hidden_states=hidden, attention_mask=mask, position_ids=positions,
                       position_embeddings=rope)
    return model.norm(hidden).view(n, block, -1)


@torch.no_grad()
def block_draft_tokens(model, aux: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor, doc: torch.Tensor,
                       k: int, chunk: int = 256) -> list[torch.Tensor]:
    """vLLM's proposals at every position of one packed stretch (the run_blocks frame): a block of
    k + 1 queries anchored at each position j, its slots 1..k's greedy draft-vocab ids, as k
    tensors [L] (tensor i - 1 = slot i, the token j + 1 + i in the shifted frame: acceptance's
    `draft_correctness` step i - 1). Anchors go `chunk` at a time: a block's states depend on its
    own context only (tested), so chunking changes nothing but memory."""
    if k > model.block_size - 1:
        raise ValueError(f"a DFlash draft trained at block {model.block_size} drafts at most "
                         f"{model.block_size - 1} tokens, not {k}")
    length = ids.shape[1]
    out = torch.zeros(k, length, dtype=torch.long, device=ids.device)
    for a in range(0, length, chunk):
        anchors = torch.arange(a, min(a + chunk, length), device=ids.device)
        states = run_blocks(model, aux, ids, pos, doc, anchors, block=k + 1)
        out[:, anchors] = model.lm_head(states[:, 1:]).argmax(-1).T
    return list(out)


def load_dflash_draft(draft_dir: Path, target: Path):
    """An export as run_blocks runs it: its config and weights; the target's embed_tokens (and
    lm_head for a full-vocab draft) where the export leaves them out, as vLLM shares them; the
    mask slots' input from mask_embedding.pt, or else the mask token's embedding (vLLM's fallback)."""
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig

    from eagle3_train.common.errors import PipelineError
    from eagle3_train.common.target_layout import read_weights
    from eagle3_train.train.draft_core import load_target_weights

    draft_dir = Path(draft_dir)
    config = DFlashSpeculatorConfig.from_pretrained(str(draft_dir))
    config.transformer_layer_config._attn_implementation = "sdpa"  # dense masks (run_blocks builds them)
    state = read_weights(draft_dir)
    model = DFlashDraftModel(config)
    model.is_dflash = True
    lc = config.transformer_layer_config
    model.block_causal = bool(getattr(lc, "is_causal", False))
    sliding = set(getattr(lc, "layer_types", None) or []) == {"sliding_attention"}
    model.draft_window = int(lc.sliding_window) if sliding and getattr(lc, "sliding_window", None) else None
    fc = state.get("fc.weight")
    if fc is not None and fc.shape != model.fc.weight.shape:  # narrower than the target (see build)
        model.fc = nn.Linear(fc.shape[1], fc.shape[0], bias=False)
    if "embed_tokens.weight" not in state or ("lm_head.weight" not in state and not model.use_draft_vocab):
        tw = load_target_weights(target)
        state.setdefault("embed_tokens.weight", tw["embed"])
        if not model.use_draft_vocab:
            state.setdefault("lm_head.weight", tw["lm_head"])
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not m.startswith("verifier_")]  # training-only copies
    if missing or unexpected:
        raise PipelineError(f"{draft_dir}: weights do not fit its config.json (missing {missing[:4]}, "
                            f"unexpected {list(unexpected)[:4]})")
    mask_file = draft_dir / MASK_FILE
    if mask_file.exists():
        mask = torch.load(mask_file, weights_only=True, map_location="cpu")
        if int(mask["mask_token_id"]) != int(config.mask_token_id):
            raise PipelineError(f"{mask_file} is for mask_token_id {mask['mask_token_id']}, config.json says "
                                f"{config.mask_token_id}")
        vec = mask["embedding"].float()
    else:
        vec = model.embed_tokens.weight[int(config.mask_token_id)].detach().float()
    model.mask_embedding = nn.Parameter(vec.clone(), requires_grad=False)
    model.verifier_lm_head = None
    model.verifier_norm = None
    return model.eval()


# ----------------------------------------------------------------------------- export

def export_dflash(model, out_dir: Path, *, extra: dict | None = None) -> Path:
    """Write the directory in speculators' DFlash format vLLM serves with `method: dflash` (config.json,
    model.safetensors, mask_embedding.pt) atomically, and check what vLLM relies on is in it."""
    from safetensors import safe_open

    out_dir = Path(out_dir)
    tmp = out_dir.parent / f"{TMP_PREFIX}{out_dir.name}"
    if tmp.exists():
        import shutil

        shutil.rmtree(tmp)
    model.save_pretrained(str(tmp), safe_serialization=True)
    c = model.config
    cfg = json.loads((tmp / "config.json").read_text())
    want = {"speculators_model_type": "dflash", "aux_hidden_state_layer_ids": list(c.aux_hidden_state_layer_ids),
            "mask_token_id": c.mask_token_id, "draft_vocab_size": c.draft_vocab_size,
            "target_hidden_size": c.target_hidden_size, "sample_from_anchor": False,
            "sliding_window_non_causal": not model.block_causal}
    for key, val in want.items():
        if cfg.get(key) != val:
            raise RuntimeError(f"export config.json has {key}={cfg.get(key)!r}, expected {val!r}")
    if cfg["transformer_layer_config"].get("model_type") != "qwen3":
        raise RuntimeError("export config.json: vLLM's DFlash draft is a qwen3 stack")
    if cfg["transformer_layer_config"].get("is_causal") is not model.block_causal:
        raise RuntimeError(f"export config.json: is_causal is not {model.block_causal}, as the draft trained")
    layer = cfg["transformer_layer_config"]
    if (window := getattr(model, "draft_window", None)) and (
            layer.get("sliding_window") != window or set(layer.get("layer_types") or []) != {"sliding_attention"}):
        raise RuntimeError(f"export config.json lacks the draft's window {window} (layer_types "
                           f"{layer.get('layer_types')}, sliding_window {layer.get('sliding_window')})")
    with safe_open(str(tmp / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    need = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    need |= {f"layers.{i}.self_attn.{n}.weight" for i in range(len(model.layers)) for n in ("q_norm", "k_norm")}
    if model.use_draft_vocab:
        need |= {"lm_head.weight", "d2t", "t2d"}
    if model.embed_tokens.weight.requires_grad:
        need.add("embed_tokens.weight")
    if missing := need - keys:
        raise RuntimeError(f"export weights lack {sorted(missing)}")
    if stray := {k for k in keys if "mask" in k}:
        raise RuntimeError(f"export weights carry {sorted(stray)}: the mask embedding belongs in {MASK_FILE}")
    mask = model.mask_embedding.detach().to("cpu", model.fc.weight.dtype).clone()
    torch.save({"mask_token_id": int(c.mask_token_id), "embedding": mask}, tmp / MASK_FILE)
    if extra:
        (tmp / "training_info.json").write_text(json.dumps(extra, indent=2, sort_keys=True, default=str) + "\n")
    atomic_dir_commit(tmp, out_dir)
    return out_dir
