"""scripts/bench/dflash_recipe.py's pieces that need no training: its flags refused in one line,
a finished run reported and not rerun, the later seeds given the first seed's steps, and the
table's means over seeds."""

from __future__ import annotations

import json

from eagle3_testkit.fixtures import REPO_ROOT
from eagle3_train.common.errors import run_main
from helpers import load_script


def test_recipe_bench_refuses_bad_flags_in_one_line(tmp_path, capsys):
    bench = load_script("bench/dflash_recipe")
    for flags, word in ((["--k", "0"], "--k"), (["--seeds", "a"], "--seeds"), (["--arms", "eagle3,mla"], "--arms"),
                        (["--arm", "nameless"], "--arm"), ([], "scripts/bench/data.py")):
        assert run_main(bench.main, ["--root", str(tmp_path / "root"), *flags]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and word in err, err
    assert not (tmp_path / "root").exists()


def row(arm: str, seed: int, steps: int, al7: float, al3: float) -> dict:
    return {"arm": arm, "seed": seed, "steps": steps, "seconds_per_step": 2.0, "train_wall_s": 99.0, "val_al": al7,
            "by_k": {"7": {"vllm_al": al7, "offline_al": al7 - 0.01, "per_position": [0.9, 0.5]},
                     "3": {"vllm_al": al3, "offline_al": al3, "per_position": [0.9]}}}


def test_recipe_bench_reports_finished_runs_and_gives_later_seeds_the_first_seeds_steps(tmp_path, monkeypatch):
    bench = load_script("bench/dflash_recipe")
    root = tmp_path / "root"
    for key in ("02", "03", "prompts"):
        (root / key).mkdir(parents=True)
    (root / "prompts" / "heldout.jsonl").write_text("")
    results = tmp_path / "res"
    for seed, al in ((1, 3.0), (2, 3.4)):
        (results / "dflash" / f"s{seed}").mkdir(parents=True)
        (results / "dflash" / f"s{seed}" / "run.json").write_text(json.dumps(row("dflash", seed, 40, al, 2.0)))
    budgets = []

    def fake_train(run_dir, d, target, flags, seed, budget, a):
        budgets.append((run_dir.parent.name, seed, budget))
        return {"budget": budget, "steps": 25 if budget == "90s" else int(budget), "seconds_per_step": 4.0,
                "train_wall_s": 100.0, "val_al": 2.0, "export": str(run_dir / "04" / "export")}

    def fake_eval(run_dir, export, d, target, a):
        return {"by_k": {"7": {"vllm_al": 2.0, "offline_al": 2.0, "per_position": [0.5]},
                         "3": {"vllm_al": 1.8, "offline_al": 1.8, "per_position": [0.5]}}}

    monkeypatch.setattr(bench, "train", fake_train)
    monkeypatch.setattr(bench, "evaluate", fake_eval)
    assert run_main(bench.main, ["--root", str(root), "--results", str(results), "--wall", "90s",
                                 "--arms", "dflash,eagle3", "--arm", "best=--draft-arch dflash --block-causal",
                                 "--one-seed", "best", "--target", str(REPO_ROOT / "assets" / "bench-reasoner")]) == 0
    # dflash's two seeds were on disk: reported, not rerun; seed by seed, the first seed at the wall
    assert budgets == [("eagle3", 1, "90s"), ("best", 1, "90s"), ("eagle3", 2, "25")]
    res = json.loads((results / "results.json").read_text())
    assert [len(res["arms"][a]) for a in ("dflash", "eagle3", "best")] == [2, 2, 1]
    md = (results / "results.md").read_text()
    assert "| dflash | 2 | 40 | 3.200 ± 0.200 | 2.000 ± 0.000 | 3.190 ± 0.200 | 2.000 ± 0.000 |" in md, md
    assert "| dflash | 1 | 40 | 2.00 | 99 | 3.000 | 3.000 | 2.000 | 2.990 | 2.000 | .90 .50 |" in md, md
