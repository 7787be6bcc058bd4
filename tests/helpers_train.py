"""Test inputs for 04: a hidden-state store (02's format) and a vocab mapping (03's format),
built here from a tiny target so the 04 tests do not depend on the 02/03 stages.

The store holds what 02 writes: per token the residual stream entering each auxiliary layer
(HF `hidden_states[i]`) and the final layer's output *before* the final norm. transformers 5.19's
`hidden_states[N]` is already normed, so the pre-norm output is taken from a hook on the norm.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch

from eagle3_train.hidden_store import STAGE as STORE_STAGE
from eagle3_train.hidden_store import write_shard
from eagle3_train.manifest import describe_target, describe_tokenizer, write_manifest

MAPPING_STAGE = "03_build_vocab_mapping"


def tokenized_examples(tokenizer, n: int, seed: int) -> list[tuple[str, list[int], list[int]]]:
    """(id, input_ids, loss_mask) for n synthetic examples, through the one tokenization module."""
    from eagle3_train.tiny import synthetic_examples
    from eagle3_train.tokenization import ChatFormat, tokenize_sample

    fmt = ChatFormat.from_tokenizer(tokenizer)
    out = []
    for i, ex in enumerate(synthetic_examples(n, seed)):
        sample = {"id": f"s{seed}-{i:05d}", "messages": [{"role": "user", "content": ex["question"]}],
                  "reasoning": ex["reasoning"], "content": ex["answer"]}
        tok = tokenize_sample(sample, fmt)
        out.append((sample["id"], tok.input_ids, tok.loss_mask))
    return out


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
    """Write a complete 02-format store for n synthetic examples run through the target."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    cfg = model.config
    num_layers = cfg.num_hidden_layers
    aux_ids = list(layer_ids) if layer_ids is not None else [2, num_layers // 2, num_layers - 3]
    examples = tokenized_examples(tokenizer, n, seed)
    tokens = 0
    for k in range(0, len(examples), shard_size):
        chunk = examples[k: k + shard_size]
        rows = {"input_ids": [], "loss_mask": [], "aux": [], "last": [], "topk_ids": [], "topk_logprobs": []}
        for _, ids, mask in chunk:
            aux, last, logits = target_features(model, ids, aux_ids)
            rows["input_ids"].append(torch.tensor(ids, dtype=torch.int32))
            rows["loss_mask"].append(torch.tensor(mask, dtype=torch.uint8))
            rows["aux"].append(aux.to(dtype))
            if topk:
                lp, ti = torch.log_softmax(logits.float(), -1).topk(topk, dim=-1)
                rows["topk_ids"].append(ti.to(torch.int32))
                rows["topk_logprobs"].append(lp.to(torch.float16))
            else:
                rows["last"].append(last.to(dtype))
        tensors = {name: torch.cat(v) for name, v in rows.items() if v}
        write_shard(out_dir, k // shard_size, [{"id": sid, "length": len(ids)} for sid, ids, _ in chunk], tensors)
        tokens += sum(len(ids) for _, ids, _ in chunk)
    write_manifest(
        out_dir, STORE_STAGE,
        config={"n": n, "seed": seed, "dtype": str(dtype), "topk": topk},
        layer_ids=aux_ids + [num_layers], hidden_size=cfg.hidden_size,
        target=describe_target(cfg, str(target_dir)),
        tokenizer=describe_tokenizer(tokenizer, str(target_dir)),
        storage={"dtype": str(dtype).replace("torch.", ""), "last": "topk" if topk else "hidden",
                 "topk": topk},
        counts={"samples": len(examples), "tokens": tokens})
    return out_dir


def build_mapping(out_dir: Path, store_dir: Path, target_dir: Path, draft_vocab_size: int) -> Path:
    """03-format vocab mapping over the store's supervised tokens (speculators' own builder)."""
    from safetensors.torch import save_file
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution
    from transformers import AutoConfig, AutoTokenizer

    from eagle3_train.hidden_store import HiddenStates

    hs = HiddenStates(store_dir)
    freq = Counter()
    for sid in hs.ids:
        s = hs.get(sid)
        freq.update(s.input_ids[s.loss_mask].tolist())
    cfg = AutoConfig.from_pretrained(target_dir)
    d2t, t2d = build_vocab_mappings_from_distribution(dict(freq), draft_vocab_size, cfg.vocab_size)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({"d2t": d2t, "t2d": t2d}, str(out_dir / "vocab_mapping.safetensors"))
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    write_manifest(out_dir, MAPPING_STAGE, config={"draft_vocab_size": draft_vocab_size},
                   tokenizer=describe_tokenizer(tokenizer, str(target_dir)),
                   target=describe_target(cfg, str(target_dir)),
                   counts={"draft_vocab_size": draft_vocab_size, "target_vocab_size": cfg.vocab_size})
    return out_dir


def train_inputs(root: Path, target_dir: Path, *, n: int, shard_size: int, draft_vocab_size: int = 96) -> dict:
    """A store and a vocab mapping for 04 under `root`: what each 04 test module starts from."""
    store = build_store(root / "store", target_dir, n=n, shard_size=shard_size)
    mapping = build_mapping(root / "map", store, target_dir, draft_vocab_size)
    return {"store": store, "map": mapping, "target": target_dir, "root": root}
