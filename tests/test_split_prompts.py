"""Held-out prompts that are held out: the split's pure choice of ids (common/split.py), the
01_split_prompts stage (disjoint train/held-out files that 01b and 05 read back with the same ids,
a rerun a no-op, another setting refused), and the manifest chain 05 reads to refuse held-out
prompts the draft trained on (common/lineage.py)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from eagle3_train.common.config import EXTRACT, TRAIN
from eagle3_train.common.errors import PipelineError, run_main
from eagle3_train.common.lineage import Unreadable, check_heldout, draft_trained_ids, trained_ids
from eagle3_train.common.manifest import manifest_identity, write_manifest
from eagle3_train.common.prompts import load_prompts
from eagle3_train.common.split import heldout_count, is_heldout, pick_heldout
from eagle3_train.split_prompts.cli import main as split_main

IDS = [f"q{i:04d}" for i in range(1000)]


# ----------------------------------------------------------------------------- the pure choice

def test_the_choice_is_seeded_exact_and_independent_of_order():
    held = pick_heldout(IDS, 50, seed=0)
    assert len(held) == 50 and held <= set(IDS)
    shuffled = IDS[:]
    random.Random(1).shuffle(shuffled)
    assert pick_heldout(shuffled, 50, seed=0) == held  # the order of the file does not matter
    assert pick_heldout(IDS, 50, seed=0) == held  # deterministic
    assert pick_heldout(IDS, 50, seed=1) != held  # the seed chooses
    # a larger count keeps the smaller one's ids (the ranking is by id): growing the held-out set
    # never moves a held-out prompt into training
    assert held <= pick_heldout(IDS, 80, seed=0)
    # disjoint by construction: the rest is exactly the ids not chosen
    assert len(set(IDS) - held) == 950


def test_the_choice_depends_on_the_id_not_on_the_other_prompts():
    held = pick_heldout(IDS, 100, seed=0)
    fewer = IDS[:500]
    # an id held out among 1000 ranks at least as low among a subset of them
    assert held & set(fewer) <= pick_heldout(fewer, 100, seed=0)


@pytest.mark.parametrize("size,total,count", [
    (200, 100200, 200), (1, 2, 1), (0.01, 1000, 10), (0.01, 150, 2), (0.01, 149, 1), (0.5, 3, 2), (0.25, 10, 3),
])
def test_sizes_are_counts_or_fractions_rounded_half_up(size, total, count):
    assert heldout_count(size, total) == count


@pytest.mark.parametrize("size,total,message", [
    (0, 10, "--heldout must be positive"), (-3, 10, "--heldout must be positive"),
    (2.5, 10, "a count must be a whole number"), (10, 10, "none left to train on"),
    (11, 10, "holds out 11 of only 10"), (0.01, 40, "holds out none"), (0.999, 10, "none left to train on"),
])
def test_bad_sizes_are_refused(size, total, message):
    with pytest.raises(PipelineError, match=message):
        heldout_count(size, total)


def test_duplicate_ids_are_refused():
    with pytest.raises(PipelineError, match="'q0001' appears twice"):
        pick_heldout(["q0000", "q0001", "q0001"], 1)
    with pytest.raises(PipelineError, match="cannot hold out 3 of 3"):
        pick_heldout(IDS[:3], 3)


# ----------------------------------------------------------------------------- the stage

def write_source(path: Path, n: int, *, start: int = 0, extra: list[dict] | None = None) -> Path:
    rows = [{"id": f"q{i:04d}", "messages": [{"role": "system", "content": "be brief"},
                                             {"role": "user", "content": f"question {i}"},
                                             {"role": "assistant", "content": "an old answer"}]}
            for i in range(start, start + n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows + (extra or [])))
    return path


def split(capsys, *argv) -> tuple[int, str, str]:
    rc = run_main(split_main, [str(a) for a in argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_the_split_writes_disjoint_sets_read_back_with_the_same_ids(tmp_path, capsys):
    src = write_source(tmp_path / "src.jsonl", 40)
    out = tmp_path / "prompts"
    rc, said, _ = split(capsys, "--input", src, "--heldout", 0.1, "--seed", 3, "--output-dir", out)
    assert rc == 0 and "4 held out" in said
    train, held = load_prompts(str(out / "train.jsonl")), load_prompts(str(out / "heldout.jsonl"))
    source = load_prompts(str(src))
    assert set(held.ids) == pick_heldout(source.ids, 4, seed=3)
    assert not set(train.ids) & set(held.ids) and len(train.ids) + len(held.ids) == 40
    assert [i for i in source.ids if i in set(train.ids)] == train.ids  # the source's order
    # what 01b would send: the same conversation (the old answer dropped), under the same id
    by_id = {p.id: p.messages for p in source.prompts}
    assert all(p.messages == by_id[p.id] for p in train.prompts + held.prompts)
    man = json.loads((out / "manifest.json").read_text())
    assert man["stage"] == "01_split_prompts" and man["counts"]["train"] == 36 and man["counts"]["heldout"] == 4
    assert man["seed"] == 3 and man["config"]["heldout"] == 0.1
    assert man["inputs"]["source"]["sha256"] == load_prompts(str(src)).source["sha256"]
    from eagle3_train.common.store import json_sha256
    assert man["split"]["heldout_ids_sha256"] == json_sha256(sorted(held.ids))


def test_a_rerun_is_a_no_op_and_other_settings_are_refused(tmp_path, capsys):
    src = write_source(tmp_path / "src.jsonl", 30)
    out = tmp_path / "prompts"
    assert split(capsys, "--input", src, "--heldout", 5, "--output-dir", out)[0] == 0
    def files():  # what the split wrote (the lock file is rewritten by every run)
        return {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in out.iterdir()
                if p.is_file() and p.name != ".lock"}

    before = files()
    rc, said, _ = split(capsys, "--input", src, "--heldout", "5", "--output-dir", out)
    assert rc == 0 and "nothing to do" in said
    assert files() == before
    (out / "heldout.jsonl").unlink()  # a file lost since: written again, the same
    assert split(capsys, "--input", src, "--heldout", 5, "--output-dir", out)[0] == 0
    assert (out / "heldout.jsonl").read_bytes() == before["heldout.jsonl"][1]
    before = files()
    for argv, key in ((["--heldout", 6], "heldout=5"), (["--heldout", 5, "--seed", 1], "seed=0"),
                      (["--heldout", 5, "--limit", 20], "limit=None")):
        rc, _, err = split(capsys, "--input", src, *argv, "--output-dir", out)
        assert rc == 2 and err.count("\n") == 1 and key in err and "--overwrite" in err, err
    # the same flags over a source whose content changed: refused too (another set of prompts)
    write_source(src, 30, start=1)
    rc, _, err = split(capsys, "--input", src, "--heldout", 5, "--output-dir", out)
    assert rc == 2 and "source=" in err, err
    assert files() == before
    rc, _, _ = split(capsys, "--input", src, "--heldout", 6, "--output-dir", out, "--overwrite")
    assert rc == 0 and len(load_prompts(str(out / "heldout.jsonl")).ids) == 6
    assert len(list(out.glob("replaced-*/heldout.jsonl"))) == 1  # the old split kept aside


@pytest.mark.parametrize("rows,argv,message", [
    (3, ["--heldout", 3], "none left to train on"),
    (3, ["--heldout", 0], "--heldout must be positive"),
    (3, ["--heldout", -1], "--heldout must be positive"),
    (3, ["--heldout", 1, "--limit", 0], "--limit must be >= 1"),
    (30, ["--heldout", 0.01], "holds out none"),
    (0, ["--heldout", 1], "no prompts selected"),
    ("dup", ["--heldout", 1], "appears twice with different conversations"),
])
def test_bad_input_is_one_error_line_and_nothing_written(tmp_path, capsys, rows, argv, message):
    if rows == "dup":
        src = write_source(tmp_path / "src.jsonl", 3, extra=[
            {"id": "q0001", "messages": [{"role": "user", "content": "another question"}]}])
    else:
        src = write_source(tmp_path / "src.jsonl", rows)
    rc, _, err = split(capsys, "--input", src, *argv, "--output-dir", tmp_path / "out")
    assert rc == 2 and err.count("\n") == 1 and err.startswith("error: ") and message in err, err
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- the chain 05 reads

def chain(tmp_path: Path, store_ids: list[str], *, split: dict | None = None, plan: bool = True,
          config: dict | None = None) -> Path:
    """A finished 04 run (its manifest beside export/) over a hidden-state store of `store_ids`
    (02's manifest, plan.json, and the tokenized data it was made from). Returns the export."""
    data = tmp_path / "tok" / "data.jsonl"
    data.parent.mkdir(parents=True)
    data.write_text("".join(json.dumps({"id": i, "input_ids": [1, 2, 3]}) + "\n" for i in store_ids))
    store = tmp_path / "hs"
    store.mkdir()
    if plan:
        (store / "plan.json").write_text(json.dumps({"shards": [{"k": 0, "ids": store_ids[::2]},
                                                                {"k": 1, "ids": store_ids[1::2]}]}))
    write_manifest(store, EXTRACT, config={}, inputs={"training_set": {"path": str(data)}})
    run = tmp_path / "run"
    (run / "export").mkdir(parents=True)
    (run / "export" / "config.json").write_text("{}")
    write_manifest(run, TRAIN, config={"hidden_states": str(store), **(config or {})},
                   inputs={"hidden_states": {"manifest_identity": manifest_identity(store)}},
                   **({"split": split} if split is not None else {}))
    return run / "export"


def test_the_trained_ids_are_the_stores_less_those_04_validated_on(tmp_path):
    ids = [f"s{i}" for i in range(20)]
    export = chain(tmp_path, ids, split={"val_fraction": 0.1, "val_ids": ["s3", "s7"]})
    assert draft_trained_ids(export) == set(ids) - {"s3", "s7"}
    # the draft's own directory holding the manifest reads the same
    assert draft_trained_ids(export.parent) == set(ids) - {"s3", "s7"}


def test_without_a_plan_the_ids_come_from_the_data_the_store_was_made_from(tmp_path):
    ids = [f"s{i}" for i in range(6)]
    assert draft_trained_ids(chain(tmp_path, ids, split={"val_ids": []}, plan=False)) == set(ids)


def test_a_recorded_fraction_without_ids_is_the_by_id_rule_unless_a_cap_moved_some_back():
    ids = [f"s{i}" for i in range(400)]
    man = {"split": {"val_fraction": 0.25}, "config": {"val_max_samples": None}}
    assert trained_ids(man, ids) == {i for i in ids if not is_heldout(i, 0.25)} != set(ids)
    capped = {"split": {"val_fraction": 0.25}, "config": {"val_max_samples": 4}}
    assert trained_ids(capped, ids) == set(ids)  # which held-out ones trained is unknown: all count
    assert trained_ids({}, ids) == set(ids)


def test_05_refuses_prompts_the_draft_trained_on_and_accepts_its_validation_ids(tmp_path, capsys):
    ids = [f"s{i}" for i in range(20)]
    export = chain(tmp_path, ids, split={"val_ids": ["s3", "s7"]})
    with pytest.raises(PipelineError) as e:
        check_heldout(export, ["new-1", "s1", "s3", "s2"])
    assert str(e.value) == ("2 of 4 --prompts ids were in the draft's training set (e.g. 's1', 's2'): pass the "
                            "split's heldout.jsonl (01_split_prompts.py)")
    check_heldout(export, ["new-1", "s3", "s7"])  # 04's validation samples were not trained on
    assert capsys.readouterr().err == ""


def test_an_unreadable_chain_is_one_warning_and_no_refusal(tmp_path, capsys):
    ids = ["s1", "s2"]
    export = chain(tmp_path / "a", ids, split={"val_ids": []})
    # a draft copied out of its run
    copied = tmp_path / "copied"
    copied.mkdir()
    (copied / "config.json").write_text("{}")
    check_heldout(copied, ["s1"])
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("warning: ") and "copied out of its run" in err[0]
    # the store 04 trained on remade since: not what the draft trained on
    write_manifest(tmp_path / "a" / "hs", EXTRACT, config={"remade": True})
    with pytest.raises(Unreadable, match="not the one 04 trained on"):
        draft_trained_ids(export)
    # the store moved away
    (tmp_path / "a" / "hs").rename(tmp_path / "a" / "hs-moved")
    check_heldout(export, ["s1"])
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "is not there" in err[0]
