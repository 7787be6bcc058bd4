"""The draft-quality benchmark's pieces that are cheap to check: the five tasks' reasoning is
well formed and its arithmetic right, deterministically; the 02 store converted for speculators'
Trainer reads back (through speculators' own dataset class) as the very samples 04 trains on."""

from __future__ import annotations

import re

import torch
from eagle3_testkit.bench_tasks import TASKS, bench_examples, write_bench_prompts
from eagle3_train.common.split import is_heldout


def check_columns(lines, pattern, op):
    """Each step line matches `pattern`; op(groups) checks its arithmetic and returns the written digit."""
    digits = []
    for line in lines:
        m = re.fullmatch(pattern, line)
        assert m, line
        digits.append(op(*map(int, m.groups())))
    return digits


def check_add(q, lines, a):
    x, y = map(int, re.fullmatch(r"What is (\d+) \+ (\d+)\?", q).groups())
    assert lines[0] == f"I add {x} and {y} digit by digit." and lines[-1] == f"So the sum is {x + y}."
    body, last = (lines[1:-2], lines[-2]) if lines[-2].startswith("Write the last") else (lines[1:-1], None)
    carry = [0]

    def step(d1, d2, c, s, w, c2):
        assert c == carry[0] and d1 + d2 + c == s and w == s % 10 and c2 == s // 10
        carry[0] = c2
        return w

    digits = check_columns(body, r"(\d) plus (\d) plus carry (\d) is (\d+), write (\d) carry (\d)\.", step)
    lead = str(carry[0]) if last else ""
    assert last is None or last == f"Write the last carry {carry[0]}." and carry[0]
    assert int(lead + "".join(map(str, digits[::-1]))) == x + y
    return x + y


def check_sub(q, lines, a):
    x, y = map(int, re.fullmatch(r"What is (\d+) - (\d+)\?", q).groups())
    assert y < x and lines[-1] == f"So the difference is {x - y}."
    borrow = [0]

    def step(d1, d2, b, r, w, b2):
        assert b == borrow[0] and r == d1 - d2 - b and w == r % 10 and b2 == int(r < 0)
        borrow[0] = b2
        return w

    digits = check_columns(lines[1:-1], r"(\d) minus (\d) minus borrow (\d) is (-?\d+), write (\d) borrow (\d)\.", step)
    assert borrow[0] == 0 and int("".join(map(str, digits[::-1]))) == x - y
    return x - y


def check_mul(q, lines, a):
    x, d = map(int, re.fullmatch(r"What is (\d+) \* (\d)\?", q).groups())
    assert lines[-1] == f"So the product is {x * d}."
    body = lines[1:-2] if lines[-2].startswith("Write the last") else lines[1:-1]
    carry = [0]

    def step(digit, k, c, p, w, c2):
        assert k == d and c == carry[0] and p == digit * d + c and w == p % 10 and c2 == p // 10
        carry[0] = c2
        return w

    digits = check_columns(body, r"(\d) times (\d) plus carry (\d) is (\d+), write (\d) carry (\d)\.", step)
    assert int((str(carry[0]) if carry[0] else "") + "".join(map(str, digits[::-1]))) == x * d
    return x * d


def check_sort(q, lines, a):
    xs = list(map(int, q.removeprefix("Sort these numbers: ").split()))
    rest = list(xs)
    for line in lines[1:-1]:
        m = re.fullmatch(r"The smallest left is (\d+), left (.*)\.", line)
        assert m and int(m.group(1)) == min(rest), line
        rest.remove(min(rest))
        assert m.group(2) == (" ".join(map(str, rest)) or "none")
    assert not rest
    return " ".join(map(str, sorted(xs)))


def check_binary(q, lines, a):
    n = int(re.fullmatch(r"Write (\d+) in binary\.", q).group(1))
    x, bits = n, []
    for line in lines[1:-1]:
        assert line == f"{x} divided by 2 is {x // 2} remainder {x % 2}.", line
        bits.append(x % 2)
        x //= 2
    assert x == 0 and int("".join(map(str, bits[::-1])), 2) == n
    return format(n, "b")


CHECKS = {"add": check_add, "sub": check_sub, "mul": check_mul, "sort": check_sort, "binary": check_binary}
ANSWERS = {"add": "The answer is {}.", "sub": "The answer is {}.", "mul": "The answer is {}.",
           "sort": "Sorted: {}.", "binary": "In binary: {}."}


def test_every_task_reasons_step_by_step_to_the_right_answer():
    examples = bench_examples(500, seed=3)
    assert {ex["task"] for ex in examples} == set(CHECKS) and len(TASKS) == 5
    for ex in examples:
        lines = ex["reasoning"].split("\n")
        want = CHECKS[ex["task"]](ex["question"], lines, ex["answer"])
        assert ex["answer"] == ANSWERS[ex["task"]].format(want)


def test_tasks_are_deterministic_by_seed(tmp_path):
    assert bench_examples(40, seed=5) == bench_examples(40, seed=5)
    assert bench_examples(40, seed=5) != bench_examples(40, seed=6)
    a = write_bench_prompts(tmp_path / "a.jsonl", 20, seed=5).read_bytes()
    assert a == write_bench_prompts(tmp_path / "b.jsonl", 20, seed=5).read_bytes()


def test_reasoning_is_long_in_the_tiny_tokenizer(k25_tokenizer):
    """~100-300 tokens of reasoning per task: long enough that a draft has structure to learn."""
    for task in CHECKS:
        exs = [ex for ex in bench_examples(100, seed=9) if ex["task"] == task]
        mean = sum(len(k25_tokenizer(ex["reasoning"])["input_ids"]) for ex in exs) / len(exs)
        assert 100 <= mean <= 300, (task, mean)


def test_speculators_reads_the_converted_store_as_04_sees_it(tmp_path, llama_target_dir):
    from eagle3_testkit.speculators_data import convert_store
    from eagle3_train.common.hidden_store import HiddenStates
    from helpers_train import build_store
    from speculators.train.data import ArrowDataset

    store_dir = build_store(tmp_path / "store", llama_target_dir, n=24, shard_size=8)
    store = HiddenStates(store_dir)
    info = convert_store(store_dir, tmp_path / "spec", val_fraction=0.25, dtype="float32", progress=False)
    train_ids = sorted(i for i in store.ids if not is_heldout(i, 0.25))
    val_ids = sorted(i for i in store.ids if is_heldout(i, 0.25))
    assert train_ids and val_ids and info["ids"] == train_ids + val_ids
    for split, ids in (("train", train_ids), ("val", val_ids)):
        ds = ArrowDataset(max_len=4096, datapath=tmp_path / "spec", on_missing="raise",
                          train_ratio=info["train_data_ratio"], split=split, hidden_states_dtype=torch.float32)
        assert len(ds) == len(ids)
        for row, sid in enumerate(ids):
            got, want = ds[row], store.get(sid)
            assert torch.equal(got["input_ids"], want.input_ids.long())
            assert torch.equal(got["loss_mask"].bool(), want.loss_mask.bool())
            assert torch.equal(got["hidden_states"], want.aux.flatten(1).float())
            assert torch.equal(got["verifier_last_hidden_states"], want.last.float())
    # A second call with the same store and split reuses the conversion; another split redoes it.
    assert convert_store(store_dir, tmp_path / "spec", val_fraction=0.25, dtype="float32") == info
    assert convert_store(store_dir, tmp_path / "spec", val_fraction=0.5, dtype="float32",
                         progress=False)["val_fraction"] == 0.5
