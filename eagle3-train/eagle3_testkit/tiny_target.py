"""Train the tiny reasoning target on CPU: a 0.56M-parameter Llama that, given a synthetic question in
the K2.5-like chat format, reasons step by step, closes with </think>, answers and stops.

Deterministic: same seed, same thread count -> same weights (checked by a test).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from eagle3_train.common.tokenization import ChatFormat, tokenize_sample

from eagle3_testkit.tiny import (
    build_tokenizer,
    deepseek_v3_config,
    llama_config,
    randomize_router_bias,
    synthetic_examples,
)


def _render(fmt, ex: dict) -> tuple[list[int], list[int]]:
    """Chat-rendered training sequence: loss only on the assistant's generated part. Built by the
    shared tokenization module, so the target learns exactly the turn layout 01c re-wraps."""
    t = tokenize_sample({"id": "tiny", "messages": [{"role": "user", "content": ex["question"]}],
                         "reasoning": ex["reasoning"], "content": ex["answer"]}, fmt)
    return t.input_ids, t.loss_mask


def train_tiny_target(out_dir: Path, steps: int = 800, batch: int = 32, lr: float = 3e-3,
                      seed: int = 0, n_examples: int = 20000, device: str = "cpu",
                      tokenizer_dir: Path | None = None, hidden: int = 64, check_n: int = 30,
                      log=print, examples=synthetic_examples, layers: int = 8, heads: int | None = None,
                      kv_heads: int = 1, intermediate: int | None = None, warmup: int = 100,
                      autocast: bool = False, save_dtype: str | None = None,
                      check_max_new_tokens: int = 200, log_every: int = 50, arch: str = "llama",
                      pad_mask: bool = True, same_length: bool = False, check=None, max_pos: int = 2048,
                      short_steps: int = 0, short_tokens: int = 0, short_batch: int | None = None,
                      even_tokens: bool = False) -> dict:
    """`examples(n, seed)` gives the task (the tiny-reasoner's by default; the bench target's is
    eagle3_testkit.bench_tasks.bench_examples); the shape arguments default to the tiny-reasoner's.
    `arch` "deepseek_v3" trains tiny.deepseek_v3_config (MLA + MoE) instead; it takes only `hidden`
    and `layers` of the shape arguments.
    `autocast` runs forward/backward in bf16 (AMX on this CPU) with fp32 master weights.
    `pad_mask` False leaves out the attention mask: the padding is on the right, so causal attention
    never reads it, and without a mask sdpa runs causal without building a T x T mask per batch.
    `same_length` fills each step with a random sequence's neighbours in length, not random ones: with
    lengths spread over 100s to 1000s of tokens, random batches are mostly padding.
    `check` replaces the greedy check: a function (out_dir) -> dict of figures.
    `short_steps` > 0 runs that many steps first on random sequences cut to their first `short_tokens`
    tokens (`short_batch` a step, `batch` by default), then the `steps` full-length ones, under one lr
    schedule: a long answer's line template and copying are learnt on cheap short steps, the positions
    up to the full length on the few full ones. Cutting keeps the per-line stop rate of a geometric length (a cut only
    censors).
    `even_tokens` weighs every token alike across steps: each step's summed loss over the tokens a step
    of its phase holds on average, not the step's mean. A step's mean weighs the tokens of short batches
    more, so on answers whose length follows from their own choices (a walk that stops when it takes an
    edge) the target learns the choices that end an answer early too likely: with batches of
    neighbours in length, 1.5-1.7x on the long task's stop edge and answers a third as long."""
    import torch
    from eagle3_train.common.progress import Progress
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True, warn_only=True)
    out_dir = Path(out_dir)
    tok_dir = out_dir / "_tokenizer"
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir) if tokenizer_dir else build_tokenizer(tok_dir)
    fmt = ChatFormat.from_tokenizer(tokenizer)
    seqs = [_render(fmt, ex) for ex in examples(n_examples, 1000 + seed)]
    # head_dim stays 32: vLLM's CPU attention kernels do not take 16.
    if arch == "deepseek_v3":
        # head_dim 32: AMX_MLA, which 05 needs once an MLA draft rides along, does not take 16.
        cfg = deepseek_v3_config(tokenizer, hidden=hidden, layers=layers, head_dim=32)
    else:
        cfg = llama_config(tokenizer, hidden=hidden, layers=layers, heads=heads or hidden // 32,
                           kv_heads=kv_heads, intermediate=intermediate or 4 * hidden, max_pos=max_pos)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    randomize_router_bias(model, seed)  # DeepSeek-V3 only: fixed, not learnt (updated outside backprop)
    model.to(device)
    model.generation_config = GenerationConfig(
        bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id, pad_token_id=cfg.pad_token_id)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    g = torch.Generator().manual_seed(seed)
    pad = cfg.pad_token_id
    t0, losses = time.time(), []
    total = short_steps + steps
    bar = Progress("target", total, unit="step", every_s=60.0)
    by_len = sorted(range(len(seqs)), key=lambda i: len(seqs[i][0]))
    # supervised tokens a sequence holds on average, cut short or whole: the even_tokens loss's divisor per sequence
    per_seq = {short: sum(sum(m[1:short_tokens if short else None]) for _, m in seqs) / len(seqs)
               for short in (True, False)}
    rank = {i: r for r, i in enumerate(by_len)}
    for step in range(total):
        short = step < short_steps
        if short:
            idx = torch.randint(len(seqs), (short_batch or batch,), generator=g).tolist()
        elif same_length:
            r = min(max(0, rank[int(torch.randint(len(seqs), (1,), generator=g))] - batch // 2), len(seqs) - batch)
            idx = by_len[r: r + batch]
        else:
            idx = torch.randint(len(seqs), (batch,), generator=g).tolist()
        cut = short_tokens if short else None
        width = max(len(seqs[i][0][:cut]) for i in idx)
        ids = torch.full((len(idx), width), pad)
        labels = torch.full((len(idx), width), -100)
        attn = torch.zeros((len(idx), width), dtype=torch.long)
        for r, i in enumerate(idx):
            s, m = seqs[i][0][:cut], seqs[i][1][:cut]
            ids[r, : len(s)] = torch.tensor(s)
            attn[r, : len(s)] = 1
            labels[r, : len(s)] = torch.tensor([t if k else -100 for t, k in zip(s, m)])
        warm = min(1.0, (step + 1) / warmup)
        for group in opt.param_groups:
            group["lr"] = lr * warm * 0.5 * (1 + math.cos(math.pi * step / total))
        norm = {"num_items_in_batch": len(idx) * per_seq[short]} if even_tokens else {}
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=ids.to(device), attention_mask=attn.to(device) if pad_mask else None,
                         labels=labels.to(device), **norm).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        # logged and reported as the step's mean loss a token, whatever it was divided by
        losses.append(loss.item() * norm["num_items_in_batch"] / int((labels[:, 1:] != -100).sum()) if norm
                      else loss.item())
        bar.update(1, loss=round(losses[-1], 4))
        if step % log_every == 0 or step == total - 1:
            log(f"step {step}/{total}{' short' if short else ''} loss {losses[-1]:.4f} ({time.time() - t0:.0f}s)")
    bar.close()
    model.to("cpu")
    if save_dtype:
        model.to(getattr(torch, save_dtype))
        model.config.dtype = save_dtype
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    stats = {"steps": steps, "batch": batch, "lr": lr,
             **({"short_steps": short_steps, "short_tokens": short_tokens, "short_batch": short_batch or batch}
                if short_steps else {}), **({"even_tokens": True} if even_tokens else {}),
             "seed": seed, "device": device,
             "examples": f"{examples.__module__}.{examples.__name__}", "n_examples": n_examples,
             "arch": arch, "layers": layers, "hidden": hidden, "autocast_bf16": autocast, "saved_dtype": save_dtype,
             "torch": torch.__version__, "threads": torch.get_num_threads(), "final_loss": losses[-1],
             "train_seconds": round(time.time() - t0, 1),
             "params": sum(p.numel() for p in model.parameters())}
    if check:
        stats.update(check(out_dir))
    elif check_n:
        stats.update(check_tiny_target(out_dir, n=check_n, examples=examples,
                                       max_new_tokens=check_max_new_tokens))
    (out_dir / "training_stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    import shutil
    shutil.rmtree(tok_dir, ignore_errors=True)
    return stats


def check_tiny_target(model_dir: Path, n: int = 30, seed: int = 7, max_new_tokens: int = 200,
                      examples=synthetic_examples) -> dict:
    """Greedy-generate on held-out questions: share that close </think> and stop at <|im_end|>."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    think_end = tokenizer.convert_tokens_to_ids("</think>")
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    closed = stopped = correct = 0
    for ex in examples(n, seed):
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": ex["question"]}], add_generation_prompt=True,
            tokenize=True, return_dict=False)
        with torch.no_grad():
            out = model.generate(torch.tensor([list(prompt)]), max_new_tokens=max_new_tokens,
                                 do_sample=False)[0, len(prompt):].tolist()
        closed += think_end in out
        stopped += im_end in out
        answer = tokenizer.decode(out[out.index(think_end) + 1:] if think_end in out else [],
                                  skip_special_tokens=True).strip()
        correct += answer == ex["answer"]
    return {"heldout": n, "closes_reasoning": closed / n, "stops": stopped / n,
            "answer_exact": correct / n}
