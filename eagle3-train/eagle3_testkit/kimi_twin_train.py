"""Train the Kimi-K2.5 twin's text model on CPU as a reasoner (the tiny-reasoner's synthetic tasks),
then package it as K2.5 (kimi_twin.write_twin).

What is committed (assets/kimi-twin-core, ~4 MB) is the twin without its ~163k never-produced
vocabulary rows: the trained tensors, the live ids and the learnt BPE ranks. `assemble_kimi_twin`
rebuilds the full 163,840-row checkpoint from it in seconds (the zero lm_head rows and the seeded
filler embeddings are exactly what training wrote), so tests cache the full twin, not retrain it.

The vocabulary is Kimi's 163,840, but the twin's BPE produces only ~1k of those ids (the rest pad
the ranks so the special tokens sit at Kimi's ids). Training runs over those ids only, with the
other ~163k logits held at exactly 0 (their lm_head rows are zero): the loss adds them in closed
form (n_rest * e^0 inside the softmax), so it is the full-vocabulary cross-entropy of the saved
model, at the cost of a 1k-wide head. Deterministic for a seed and thread count.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path

from eagle3_testkit.kimi_twin import (
    KIMI_VOCAB,
    build_kimi_tokenizer,
    kimi_text_config,
    kimi_wrapper_config,
    read_ranks,
    write_ranks,
    write_twin,
)

CORE_TENSORS, CORE_META, CORE_RANKS = "text.safetensors", "core.json", "bpe_ranks.tiktoken"
from eagle3_train.common.tokenization import ChatFormat, tokenize_sample

from eagle3_testkit.tiny import randomize_router_bias, synthetic_examples


def _reasoning(ex: dict, i: int) -> str:
    # Real reasoning usually ends with a newline before </think>; two samples in three do here.
    return ex["reasoning"] + ("\n" if i % 3 else "")


def render(tokenizer, ex: dict, i: int) -> tuple[list[int], list[int]]:
    """Chat-rendered training sequence, loss only on what the assistant generates. Built by the
    shared tokenization module, so the twin learns exactly the turn layout 01c re-wraps."""
    fmt = ChatFormat.from_tokenizer(tokenizer)
    t = tokenize_sample({"id": f"twin-{i}", "messages": [{"role": "user", "content": ex["question"]}],
                         "reasoning": _reasoning(ex, i), "content": ex["answer"]}, fmt)
    return list(t.input_ids), [int(m) for m in t.loss_mask]


def live_ids(tokenizer_dir: Path) -> list[int]:
    """The ids the twin's tokenizer can produce: its learnt BPE ranks and the named specials."""
    conf = json.loads((Path(tokenizer_dir) / "tokenizer_config.json").read_text())
    return list(range(conf["bpe_real_tokens"])) + sorted(int(i) for i in conf["added_tokens_decoder"])


def train_kimi_twin(out_dir: Path, steps: int = 240, batch: int = 8, lr: float = 4e-3, seed: int = 0,
                    n_examples: int = 3000, hidden: int = 64, layers: int = 4,
                    tokenizer_dir: Path | None = None, log=print) -> dict:
    import torch
    from safetensors.torch import load_file
    from transformers import DeepseekV3ForCausalLM

    from eagle3_testkit.kimi_twin import load_kimi_tokenizer

    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True, warn_only=True)
    out_dir = Path(out_dir)
    work = out_dir.with_name(out_dir.name + ".work")
    shutil.rmtree(work, ignore_errors=True)
    tok_dir = Path(tokenizer_dir) if tokenizer_dir else build_kimi_tokenizer(work / "tokenizer")
    tokenizer = load_kimi_tokenizer(tok_dir)
    live = live_ids(tok_dir)
    to_compact = torch.full((KIMI_VOCAB,), -1, dtype=torch.long)
    to_compact[torch.tensor(live)] = torch.arange(len(live))
    n_rest = KIMI_VOCAB - len(live)
    seqs = [render(tokenizer, ex, i) for i, ex in enumerate(synthetic_examples(n_examples, seed=1000 + seed))]

    full_cfg = kimi_text_config(hidden=hidden, layers=layers)
    compact_cfg = kimi_text_config(hidden=hidden, layers=layers)
    compact_cfg.vocab_size = len(live)
    compact_cfg.pad_token_id = int(to_compact[full_cfg.pad_token_id])
    model = DeepseekV3ForCausalLM(compact_cfg)
    randomize_router_bias(model, seed)  # fixed, not learnt (DeepSeek updates it outside backprop)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    g = torch.Generator().manual_seed(seed)
    rest = torch.tensor(math.log(n_rest))
    t0, losses = time.time(), []
    for step in range(steps):
        idx = torch.randint(len(seqs), (batch,), generator=g).tolist()
        width = max(len(seqs[i][0]) for i in idx)
        ids = torch.zeros((batch, width), dtype=torch.long)
        labels = torch.full((batch, width), -100)
        attn = torch.zeros((batch, width), dtype=torch.long)
        for r, i in enumerate(idx):
            s, m = seqs[i]
            c = to_compact[torch.tensor(s)]
            ids[r, : len(s)] = c
            attn[r, : len(s)] = 1
            labels[r, : len(s)] = torch.where(torch.tensor(m, dtype=torch.bool), c, -100)
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / 50) * 0.5 * (1 + math.cos(math.pi * step / steps))
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
        # The ~163k ids the BPE never produces: logit exactly 0 each, summed in closed form.
        logits = torch.cat([logits, rest.expand(*logits.shape[:2], 1)], dim=-1)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if step % 50 == 0 or step == steps - 1:
            log(f"step {step}/{steps} loss {loss.item():.4f} ({time.time() - t0:.0f}s)")

    state = _full_vocab(model.state_dict(), live, hidden, seed)
    full = DeepseekV3ForCausalLM(full_cfg)
    full.load_state_dict(state)
    full.save_pretrained(work / "text")  # transformers' on-disk names for the text model
    text_state = load_file(work / "text" / "model.safetensors")
    stats = {"steps": steps, "batch": batch, "lr": lr, "seed": seed, "hidden": hidden, "layers": layers,
             "torch": torch.__version__,
             "threads": torch.get_num_threads(), "final_loss": losses[-1], "live_ids": len(live),
             "train_seconds": round(time.time() - t0, 1), "params": sum(p.numel() for p in full.parameters())}
    write_twin(out_dir, text_state, kimi_wrapper_config(full_cfg), tok_dir, extra=stats)
    shutil.rmtree(work, ignore_errors=True)
    return stats


def _full_vocab(state: dict, live: list[int], hidden: int, seed: int) -> dict:
    """Scatter the live rows into Kimi's full vocabulary; the rest get zero lm_head rows (logit 0,
    as trained) and small seeded random embeddings (never looked up)."""
    import torch

    state = dict(state)
    embed = torch.randn(KIMI_VOCAB, hidden, generator=torch.Generator().manual_seed(seed + 2)) * 0.02
    head = torch.zeros(KIMI_VOCAB, hidden)
    embed[torch.tensor(live)] = state["model.embed_tokens.weight"]
    head[torch.tensor(live)] = state["lm_head.weight"]
    state["model.embed_tokens.weight"], state["lm_head.weight"] = embed, head
    return state


def save_core(twin_dir: Path, core_dir: Path) -> Path:
    """The committed part of a trained twin: its tensors at the live vocabulary rows only."""
    from safetensors.torch import load_file, save_file

    twin_dir, core_dir = Path(twin_dir), Path(core_dir)
    core_dir.mkdir(parents=True, exist_ok=True)
    stats = json.loads((twin_dir / "training_stats.json").read_text())
    live = live_ids(twin_dir)
    state = {k.removeprefix("language_model."): v for k, v in load_file(twin_dir / "model.safetensors").items()
             if k.startswith("language_model.")}
    for k in ("model.embed_tokens.weight", "lm_head.weight"):
        state[k] = state[k][live].contiguous()
    save_file(state, core_dir / CORE_TENSORS, metadata={"format": "pt"})
    n_real = json.loads((twin_dir / "tokenizer_config.json").read_text())["bpe_real_tokens"]
    ranks = read_ranks(twin_dir / "tiktoken.model")
    write_ranks(core_dir / CORE_RANKS, {t: r for t, r in ranks.items() if r < n_real})
    (core_dir / CORE_META).write_text(json.dumps({"live_ids": live, "stats": stats}) + "\n")
    return core_dir


def assemble_kimi_twin(core_dir: Path, out_dir: Path) -> Path:
    """The full twin (163,840-row vocabulary, K2.5 packaging, tokenizer) from its committed core."""
    from safetensors.torch import load_file

    core_dir, out_dir = Path(core_dir), Path(out_dir)
    meta = json.loads((core_dir / CORE_META).read_text())
    stats = meta["stats"]
    tok_dir = build_kimi_tokenizer(out_dir.with_name(out_dir.name + ".tokenizer"),
                                   ranks=read_ranks(core_dir / CORE_RANKS))
    state = _full_vocab(load_file(core_dir / CORE_TENSORS), meta["live_ids"], stats["hidden"], stats["seed"])
    cfg = kimi_wrapper_config(kimi_text_config(hidden=stats["hidden"], layers=stats["layers"]))
    write_twin(out_dir, state, cfg, tok_dir, extra=stats)
    shutil.rmtree(tok_dir, ignore_errors=True)
    return out_dir
