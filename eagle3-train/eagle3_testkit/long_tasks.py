"""A task with long answers and real entropy at temperature 1.0, for the long-answer benchmark target.

Random walks on one of two fixed graphs over the tiny tokenizer's 20 words, the prompt naming the
start and the graph ("by day" or "by night"): each node has two successors, and each step of the
reasoning names the current node, its two successors in that graph and the one taken, chosen at
random:

    Walk from apple by night.
    <think>I walk from apple by night.
    - apple is river or stone, write stone.
    - stone is lemon or apple, write apple.
    ...
    So the last is apple.</think>The answer is apple.

So one token in 11 is a coin flip (what no draft can know) and the rest follows from rules a tiny
target learns in minutes: the node just taken, the graph's successors (which graph: the prompt, or
any earlier step), the choice among them. The text is the same kind of text at token 100 and at
token 5,000, so acceptance that falls along the answer is the draft's doing, not the target's.

The walk stops the first time it takes its graph's stop edge (STOPS: from a node the walk rarely
visits, ~1 step in 170 by day and 190 by night), a rule read off the step just written, so the
target learns it exactly, and trained with every token weighing the same (train_tiny_target's
even_tokens) its sampled answers are as long as the task's. Walks that would pass MAX_STEPS are
drawn again, so every training answer ends by the rule. Greedy decoding stops
only if the walk the target prefers crosses the stop edge. Same chat format and tokenizer as the
tiny target (eagle3_testkit.tiny); the same (n, seed) always gives the same list.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from eagle3_testkit.tiny import _WORDS

MAX_STEPS = 540  # ~6k tokens (~11 a step): the target's max_position_embeddings (8192) leaves room for the prompt
STEP = re.compile(r"- (\w+) is (\w+) or (\w+), write (\w+)\.")
PROMPT = re.compile(r"Walk from (\w+) by (\w+)\.")


def _graph(seed: int) -> dict[str, tuple[str, str]]:
    rng = random.Random(seed)
    return {n: tuple(rng.sample([m for m in _WORDS if m != n], 2)) for n in _WORDS}


# Seeds whose graphs leave one node unreached, with a node the walk visits ~1 step in 85 (day) and 95
# (night): its first edge, taken half the time from there, is the stop.
GRAPHS = {"day": _graph(9), "night": _graph(27)}
STOPS = {"day": ("forest", GRAPHS["day"]["forest"][0]), "night": ("candle", GRAPHS["night"]["candle"][0])}


def task_walk(rng: random.Random) -> tuple[str, str, str]:
    mode = rng.choice(sorted(GRAPHS))
    succ, stop = GRAPHS[mode], STOPS[mode]
    while True:
        start = cur = rng.choice(_WORDS)
        steps, edge = [], None
        while edge != stop and len(steps) < MAX_STEPS:
            a, b = succ[cur]
            edge = (cur, rng.choice((a, b)))
            steps.append(f"- {cur} is {a} or {b}, write {edge[1]}.")
            cur = edge[1]
        if edge == stop:
            break
    reasoning = f"I walk from {start} by {mode}.\n" + "\n".join(steps) + f"\nSo the last is {cur}."
    return f"Walk from {start} by {mode}.", reasoning, f"The answer is {cur}."


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
    the last one taken, successors as the prompt's graph has them, a successor taken), the share
    of choices that took the first successor (~0.5 when the target samples, 0 or 1 when greedy),
    the stop edges it walked past without stopping, and whether its last step is the stop edge."""
    m = PROMPT.fullmatch(question.strip())
    cur, succ = (m.group(1), GRAPHS.get(m.group(2), {})) if m else (None, {})
    stop = STOPS.get(m.group(2)) if m else None
    steps = good = first = stops = 0
    edge = None
    for line in reasoning.split("\n"):
        s = STEP.fullmatch(line.strip())
        if not s:
            continue
        steps += 1
        node, a, b, nxt = s.groups()
        ok = node == cur and succ.get(node) == (a, b) and nxt in (a, b)
        good += ok
        first += nxt == a
        edge = (node, nxt)
        stops += edge == stop
        cur = nxt
    ends = edge is not None and edge == stop
    return {"steps": steps, "well_formed": good, "first_taken": first, "ends_on_stop": ends,
            "passed_stop": stops - ends}


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
