"""Five synthetic tasks with long step-by-step reasoning, for the draft-quality benchmark target.

The tiny-reasoner's tasks are short (a few dozen tokens of reasoning) and easy, so every recipe
learns them; these run to ~100-300 tokens of a fixed procedure each (multi-digit addition with
carries, subtraction with borrows, multiplication by a digit, selection sort, binary conversion),
which leaves a draft real structure to learn and real mistakes to make. Same chat format and
tokenizer as the tiny target (eagle3_testkit.tiny); the same (n, seed) always gives the same list.
"""

from __future__ import annotations

import json
import random
from pathlib import Path


def _digits(n: int, width: int) -> list[int]:
    """Least significant first, zero-padded to `width`."""
    return [int(c) for c in str(n).zfill(width)[::-1]]


def task_add(rng: random.Random) -> tuple[str, str, str]:
    a, b = rng.randint(100, 99999), rng.randint(100, 99999)
    width = max(len(str(a)), len(str(b)))
    da, db = _digits(a, width), _digits(b, width)
    steps, carry = [], 0
    for x, y in zip(da, db):
        s = x + y + carry
        steps.append(f"{x} plus {y} plus carry {carry} is {s}, write {s % 10} carry {s // 10}.")
        carry = s // 10
    if carry:
        steps.append(f"Write the last carry {carry}.")
    reasoning = f"I add {a} and {b} digit by digit.\n" + "\n".join(steps) + f"\nSo the sum is {a + b}."
    return f"What is {a} + {b}?", reasoning, f"The answer is {a + b}."


def task_sub(rng: random.Random) -> tuple[str, str, str]:
    a = rng.randint(1000, 99999)
    b = rng.randint(100, a - 1)
    width = len(str(a))
    da, db = _digits(a, width), _digits(b, width)
    steps, borrow = [], 0
    for x, y in zip(da, db):
        r = x - y - borrow
        nxt = int(r < 0)
        steps.append(f"{x} minus {y} minus borrow {borrow} is {r}, write {r + 10 * nxt} borrow {nxt}.")
        borrow = nxt
    reasoning = (f"I subtract {b} from {a} digit by digit.\n" + "\n".join(steps)
                 + f"\nSo the difference is {a - b}.")
    return f"What is {a} - {b}?", reasoning, f"The answer is {a - b}."


def task_mul(rng: random.Random) -> tuple[str, str, str]:
    a, d = rng.randint(100, 99999), rng.randint(2, 9)
    steps, carry = [], 0
    for x in _digits(a, len(str(a))):
        p = x * d + carry
        steps.append(f"{x} times {d} plus carry {carry} is {p}, write {p % 10} carry {p // 10}.")
        carry = p // 10
    if carry:
        steps.append(f"Write the last carry {carry}.")
    reasoning = (f"I multiply {a} by {d} digit by digit.\n" + "\n".join(steps)
                 + f"\nSo the product is {a * d}.")
    return f"What is {a} * {d}?", reasoning, f"The answer is {a * d}."


def task_sort(rng: random.Random) -> tuple[str, str, str]:
    xs = [rng.randint(0, 99) for _ in range(rng.randint(4, 7))]
    rest, steps = list(xs), []
    while rest:
        m = min(rest)
        rest.remove(m)
        steps.append(f"The smallest left is {m}, left {' '.join(map(str, rest)) or 'none'}.")
    out = " ".join(map(str, sorted(xs)))
    reasoning = (f"I sort {' '.join(map(str, xs))} by taking the smallest each time.\n" + "\n".join(steps)
                 + f"\nSo the order is {out}.")
    return f"Sort these numbers: {' '.join(map(str, xs))}", reasoning, f"Sorted: {out}."


def task_binary(rng: random.Random) -> tuple[str, str, str]:
    n = rng.randint(16, 511)
    steps, x, bits = [], n, []
    while x:
        steps.append(f"{x} divided by 2 is {x // 2} remainder {x % 2}.")
        bits.append(x % 2)
        x //= 2
    out = "".join(map(str, reversed(bits)))
    reasoning = (f"I write {n} in binary by dividing by 2.\n" + "\n".join(steps)
                 + f"\nThe remainders from last to first are {out}.")
    return f"Write {n} in binary.", reasoning, f"In binary: {out}."


TASKS = (task_add, task_sub, task_mul, task_sort, task_binary)


def bench_examples(n: int, seed: int) -> list[dict]:
    """n question/reasoning/answer triples, the tasks in turn; deterministic in (n, seed)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        task = TASKS[i % len(TASKS)]
        q, r, a = task(rng)
        out.append({"question": q, "reasoning": r, "answer": a, "task": task.__name__[5:]})
    return out


def write_bench_prompts(path: Path, n: int, seed: int) -> Path:
    """01b's input (openai messages), each with the original answer as a last turn 01b replaces."""
    from eagle3_train.common.store import atomic_write_text

    lines = [json.dumps({"id": f"b{seed}-{i:05d}", "task": ex["task"], "messages": [
        {"role": "user", "content": ex["question"]}, {"role": "assistant", "content": ex["answer"]}]})
        for i, ex in enumerate(bench_examples(n, seed))]
    atomic_write_text(Path(path), "\n".join(lines) + "\n")
    return Path(path)
