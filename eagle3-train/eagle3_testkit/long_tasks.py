"""A task with long answers and real entropy at temperature 1.0, for the long-answer benchmark target.

Random walks on a small graph given in the prompt: each node has two successors, and each step of
the reasoning names the current node, its two successors (looked up in the prompt, however far
back it is) and the one taken, chosen at random:

    Walk from apple. apple is river or stone, river is tiger or apple, ...
    <think>I walk from apple.
    - apple is river or stone, write stone.
    - stone is lemon or apple, write apple.
    ...
    So the last is apple.</think>The answer is apple.

So one token in 11 is a coin flip (what a draft cannot know), the rest follows from earlier tokens
(the node just taken) and from the prompt (the successors). No step counter: multi-digit increments
cost a small target more steps than anything else here. The "- " spells each node as the prompt
does (" apple"); at the start of a line the tokenizer would split it into pieces. The walk stops
after each step with probability 1/STOP_EVERY: geometric lengths, mean ~1.7k tokens in the tiny
tokenizer, one answer in ten past 4k, none past MAX_STEPS steps. Greedy decoding of a target that
learned the task never stops (stopping is never the likelier choice), so its greedy answer runs to
the token limit. Same chat format and tokenizer as the tiny target (eagle3_testkit.tiny); the same
(n, seed) always gives the same list.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from eagle3_testkit.tiny import _WORDS

NODES = 8
STOP_EVERY = 170  # mean steps of the geometric walk length (~11 tokens a step)
MAX_STEPS = 540  # ~6k tokens: the target's max_position_embeddings (8192) leaves room for the prompt
STEP = re.compile(r"- (\w+) is (\w+) or (\w+), write (\w+)\.")


def task_walk(rng: random.Random) -> tuple[str, str, str]:
    names = rng.sample(_WORDS, NODES)
    succ = {n: rng.sample([m for m in names if m != n], 2) for n in names}
    start = cur = rng.choice(names)
    graph = ", ".join(f"{n} is {a} or {b}" for n, (a, b) in succ.items())
    steps = []
    while True:
        a, b = succ[cur]
        nxt = rng.choice((a, b))
        steps.append(f"- {cur} is {a} or {b}, write {nxt}.")
        cur = nxt
        if len(steps) >= MAX_STEPS or rng.random() < 1 / STOP_EVERY:
            break
    reasoning = f"I walk from {start}.\n" + "\n".join(steps) + f"\nSo the last is {cur}."
    return f"Walk from {start}. {graph}.", reasoning, f"The answer is {cur}."


def long_examples(n: int, seed: int) -> list[dict]:
    """n question/reasoning/answer triples; deterministic in (n, seed)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        q, r, a = task_walk(rng)
        out.append({"question": q, "reasoning": r, "answer": a, "task": "walk"})
    return out


def write_long_prompts(path: Path, n: int, seed: int) -> Path:
    """01b's input (openai messages), each with the original answer as a last turn 01b replaces."""
    from eagle3_train.common.store import atomic_write_text

    lines = [json.dumps({"id": f"l{seed}-{i:05d}", "task": ex["task"], "messages": [
        {"role": "user", "content": ex["question"]}, {"role": "assistant", "content": ex["answer"]}]})
        for i, ex in enumerate(long_examples(n, seed))]
    atomic_write_text(Path(path), "\n".join(lines) + "\n")
    return Path(path)


def walk_check(question: str, reasoning: str) -> dict:
    """How well a generated reasoning follows the walk: steps, steps well formed (current node =
    the last one taken, successors as the prompt has them, a successor taken), and the share
    of choices that took the first successor (~0.5 when the target samples, 0 or 1 when greedy)."""
    succ = {n: (a, b) for n, a, b in re.findall(r"(\w+) is (\w+) or (\w+)", question.split(". ", 1)[-1])}
    m = re.match(r"Walk from (\w+)\.", question)
    cur = m.group(1) if m else None
    steps = good = first = 0
    for line in reasoning.split("\n"):
        s = STEP.fullmatch(line.strip())
        if not s:
            continue
        steps += 1
        node, a, b, nxt = s.groups()
        ok = node == cur and succ.get(node) == (a, b) and nxt in (a, b)
        good += ok
        first += nxt == a
        cur = nxt
    return {"steps": steps, "well_formed": good, "first_taken": first}


def length_stats(lengths: list[int]) -> dict:
    """mean, p50, p90, max and the share at or past 4k of a list of answer lengths (tokens)."""
    xs = sorted(lengths)
    if not xs:
        return {"n": 0}
    at = lambda q: xs[min(len(xs) - 1, int(q * len(xs)))]  # noqa: E731
    return {"n": len(xs), "mean": round(sum(xs) / len(xs), 1), "p50": at(0.5), "p90": at(0.9), "max": xs[-1],
            "share_4k": round(sum(x >= 4096 for x in xs) / len(xs), 3)}


def check_long_target(model_dir: Path, n: int = 8, seed: int = 7, max_new_tokens: int = 6000) -> dict:
    """Sample (temperature 1.0) answers to n held-out questions in transformers: their lengths, the
    share that close </think> and stop, and how well the walk is followed (see walk_check)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    think_end = tokenizer.convert_tokens_to_ids("</think>")
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    torch.manual_seed(seed)
    lengths, closed, stopped, steps, good, first = [], 0, 0, 0, 0, 0
    for ex in long_examples(n, seed):
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": ex["question"]}],
                                               add_generation_prompt=True, tokenize=True, return_dict=False)
        with torch.no_grad():
            out = model.generate(torch.tensor([list(prompt)]), max_new_tokens=max_new_tokens, do_sample=True,
                                 temperature=1.0, top_k=0, top_p=1.0)[0, len(prompt):].tolist()
        lengths.append(len(out))
        closed += think_end in out
        stopped += im_end in out
        w = walk_check(ex["question"], tokenizer.decode(out[:out.index(think_end)] if think_end in out else out))
        steps, good, first = steps + w["steps"], good + w["well_formed"], first + w["first_taken"]
    return {"check_sampled": n, "check_lengths": length_stats(lengths), "closes_reasoning": closed / n,
            "stops": stopped / n, "steps_well_formed": round(good / max(steps, 1), 4),
            "first_successor_taken": round(first / max(steps, 1), 4)}
