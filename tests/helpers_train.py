"""Test inputs for 04: a hidden-state store (02's format) and a vocab mapping (03's format),
built here from a tiny target so the 04 tests do not depend on the 02/03 stages, but written
through the stages' own writers (fixtures.synthetic_training_set, hidden_store.encode/write_shard,
vocab.save_mapping, manifest.write_manifest).

The store holds what 02 writes: per token the residual stream entering each auxiliary layer
(HF `hidden_states[i]`) and the final layer's output *before* the final norm. transformers 5.19's
`hidden_states[N]` is already normed, so the pre-norm output is taken from a hook on the norm.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch
from eagle3_testkit.fixtures import synthetic_training_set
from eagle3_train.common import hidden_store as hs
from eagle3_train.common.manifest import describe_target, describe_tokenizer, write_manifest
from eagle3_train.extract.stage import default_aux_layers
from eagle3_train.tokenize.dataset import TrainingSet
from eagle3_train.vocab import mapping as vocab

PLAIN_NAME = {dtype: name for name, dtype in hs.PLAIN.items()}


@torch.no_grad()
def target_features(model, ids: list[int], layer_ids: list[int]):
    """aux [T, n_aux, H] and last (pre-norm) [T, H] and full logits [T, V] of one sequence."""
    captured = {}
    hook = model.model.norm.register_forward_hook(lambda m, inp, out: captured.__setitem__("last", inp[0]))
    try:
        out = model(torch.tensor([ids]), output_hidden_states=True)
    finally:
        hook.remove()
    aux = torch.stack([out.hidden_states[i][0] for i in layer_ids], dim=1)
    return aux, captured["last"][0], out.logits[0]


def build_store(out_dir: Path, target_dir: Path, *, n: int = 48, seed: int = 0,
                layer_ids: list[int] | None = None, dtype: torch.dtype = torch.float32,
                topk: int | None = None, shard_size: int = 16) -> Path:
    """Write a complete 02-format store for n synthetic examples run through the target (their
    tokenized set, 01c's format, beside it in `<out_dir>-data`). With `topk`, the target's top-k
    log-probabilities replace the last hidden state and aux stays plain (02 quantises aux for
    top-k stores; the reader takes either), so top-k and dense stores differ in the target only."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    cfg = model.config
    num_layers = cfg.num_hidden_layers
    aux_ids = list(layer_ids) if layer_ids is not None else default_aux_layers(num_layers)
    data = synthetic_training_set(out_dir.with_name(out_dir.name + "-data"), target_dir, n=n, seed=seed,
                                  id_width=5)
    examples = [(rec["id"], rec["input_ids"], rec["loss_mask"]) for rec in TrainingSet(data)]
    fmt = PLAIN_NAME[dtype]
    tokens = 0
    for k in range(0, len(examples), shard_size):
        chunk = examples[k: k + shard_size]
        rows = {"input_ids": [], "loss_mask": [], "aux": [], "last": [], "topk_ids": [], "topk_logprobs": []}
        for _, ids, mask in chunk:
            aux, last, logits = target_features(model, ids, aux_ids)
            rows["input_ids"].append(torch.tensor(ids))
            rows["loss_mask"].append(torch.tensor(mask))
            rows["aux"].append(aux)
            rows["last"].append(last)
            if topk:
                lp, ti = torch.log_softmax(logits.float(), -1).topk(topk, dim=-1)
                rows["topk_ids"].append(ti.to(torch.int32))
                rows["topk_logprobs"].append(lp.to(torch.float16))
        cat = {name: torch.cat(v) for name, v in rows.items() if v}
        tensors = hs.encode(fmt, cat["input_ids"], cat["loss_mask"], cat["aux"], cat["last"])
        if topk:
            del tensors["last"]
            tensors |= {"topk_ids": cat["topk_ids"], "topk_logprobs": cat["topk_logprobs"]}
        hs.write_shard(out_dir, k // shard_size, [{"id": sid, "length": len(ids)} for sid, ids, _ in chunk],
                       tensors)
        tokens += sum(len(ids) for _, ids, _ in chunk)
    storage = hs.describe_storage(fmt, len(aux_ids), cfg.hidden_size)
    if topk:
        storage |= {"last": "topk", "topk": topk}
    write_manifest(
        out_dir, hs.STAGE,
        config={"n": n, "seed": seed, "dtype": str(dtype), "topk": topk},
        layer_ids=aux_ids + [num_layers], aux_layer_ids=aux_ids, last_layer_id=num_layers,
        hidden_size=cfg.hidden_size,
        target=describe_target(cfg, str(target_dir)),
        tokenizer=describe_tokenizer(tokenizer, str(target_dir)),
        storage=storage, dtype=storage["aux"],
        counts={"samples": len(examples), "tokens": tokens})
    return out_dir


def build_mapping(out_dir: Path, store_dir: Path, target_dir: Path, draft_vocab_size: int) -> Path:
    """03-format vocab mapping over the store's supervised tokens (speculators' own builder)."""
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution
    from transformers import AutoConfig, AutoTokenizer

    store = hs.HiddenStates(store_dir)
    freq = Counter()
    for sid in store.ids:
        s = store.get(sid)
        freq.update(s.input_ids[s.loss_mask].tolist())
    cfg = AutoConfig.from_pretrained(target_dir)
    d2t, t2d = build_vocab_mappings_from_distribution(dict(freq), draft_vocab_size, cfg.vocab_size)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab.save_mapping(out_dir / vocab.MAPPING, d2t.numpy(), t2d.numpy())
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    write_manifest(out_dir, vocab.STAGE, config={"draft_vocab_size": draft_vocab_size},
                   tokenizer=describe_tokenizer(tokenizer, str(target_dir)),
                   target=describe_target(cfg, str(target_dir)),
                   counts={"draft_vocab_size": draft_vocab_size, "target_vocab_size": cfg.vocab_size})
    return out_dir


def train_inputs(root: Path, target_dir: Path, *, n: int, shard_size: int, draft_vocab_size: int = 96) -> dict:
    """A store and a vocab mapping for 04 under `root`: what each 04 test module starts from."""
    store = build_store(root / "store", target_dir, n=n, shard_size=shard_size)
    mapping = build_mapping(root / "map", store, target_dir, draft_vocab_size)
    return {"store": store, "map": mapping, "target": target_dir, "root": root}


def tgt2draft(draft) -> torch.Tensor:
    """Target id -> its draft-vocab index (-1 outside), for an Objective on top-k targets."""
    t2d = draft.t2d.bool()
    ids = t2d.nonzero().squeeze(1)
    out = torch.full((t2d.shape[0],), -1, dtype=torch.long)
    out[ids] = torch.arange(ids.shape[0])
    return out
