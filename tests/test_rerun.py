"""The rerun policy (rerun.py) and the typed stage config base (config.py), directly."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest
from eagle3_train.common import rerun
from eagle3_train.common.config import STAGES, StageConfig, require, setting
from eagle3_train.common.errors import PipelineError
from eagle3_train.common.manifest import read_manifest, write_manifest


@dataclass(kw_only=True)
class Toy(StageConfig):
    stage: ClassVar[str] = "99_toy"
    outputs: ClassVar[tuple[str, ...] | None] = ("out.jsonl",)
    claims: ClassVar[tuple[str, ...]] = ("out.jsonl",)

    data: str = setting(help="input file")
    size: int = setting(8, help="how many")
    api_key: str = setting("EMPTY", help="key", secret=True, resume=True)
    every: float = setting(30.0, help="seconds between lines (default: 30, 0 = never)", resume=True)
    overwrite: bool = setting(False, help="start over", resume=True)

    def validate(self):
        require(self.size >= 1, f"--size must be positive, not {self.size}")


def toy(tmp_path, **kw) -> Toy:
    return Toy(**{"output_dir": tmp_path / "o", "data": "d.jsonl", **kw})


# ----------------------------------------------------------------------------- the config base

def test_config_is_built_from_args_validated_and_serialised(tmp_path):
    ns = argparse.Namespace(output_dir=str(tmp_path), data="x", size=3, api_key="sk-1", every=5.0, overwrite=False)
    cfg = Toy.from_args(ns)
    assert cfg.output_dir == tmp_path and isinstance(cfg.output_dir, Path)
    d = cfg.to_dict()
    assert d == {"output_dir": str(tmp_path), "data": "x", "size": 3, "api_key": "<redacted>", "every": 5.0,
                 "overwrite": False}
    json.dumps(d)  # manifest-ready
    assert cfg.identity() == {"data": "x", "size": 3}
    assert Toy.resumable() == {"output_dir", "api_key", "every", "overwrite"}
    with pytest.raises(PipelineError, match="--size must be positive, not 0"):
        Toy.from_args(argparse.Namespace(**{**vars(ns), "size": 0}))
    with pytest.raises(TypeError, match="no field for argument.*stray"):
        Toy.from_args(argparse.Namespace(**vars(ns), stray=1))


def test_arg_gives_dest_default_and_help_from_the_field():
    assert Toy.arg("size") == {"dest": "size", "default": 8, "help": "how many (default: 8)"}
    assert Toy.arg("data") == {"dest": "data", "required": True, "help": "input file"}
    assert Toy.help("every") == "seconds between lines (default: 30, 0 = never)"  # says it already
    p = argparse.ArgumentParser()
    p.add_argument("--output-dir", **Toy.arg("output_dir"))
    p.add_argument("--data", **Toy.arg("data"))
    p.add_argument("--size", type=int, **Toy.arg("size"))
    assert Toy.from_args(p.parse_args(["--output-dir", "o", "--data", "d"])).size == 8


def test_stage_ids_are_the_script_names():
    import eagle3_train

    scripts = Path(eagle3_train.__file__).parents[1]
    assert all((scripts / f"{s}.py").exists() for s in STAGES), STAGES


def test_a_manifest_with_a_legacy_stage_id_is_still_read(tmp_path):
    write_manifest(tmp_path, "tokenize", config={})
    assert read_manifest(tmp_path, "01c_tokenize")["stage"] == "tokenize"
    with pytest.raises(PipelineError, match="expected '02_extract_hidden_states'"):
        read_manifest(tmp_path, "02_extract_hidden_states")


# ----------------------------------------------------------------------------- the policy

def test_first_run_records_and_the_same_run_resumes(tmp_path):
    cfg = toy(tmp_path)
    assert rerun.prepare(cfg, {"data_sha256": "aa"}) is None
    rec = json.loads((cfg.output_dir / rerun.RUN).read_text())
    assert rec == {"stage": "99_toy", "config": {"data": "d.jsonl", "size": 8}, "inputs": {"data_sha256": "aa"}}
    # resumable settings may change; the record is not rewritten
    before = (cfg.output_dir / rerun.RUN).read_bytes()
    assert rerun.prepare(toy(tmp_path, every=1.0, api_key="other"), {"data_sha256": "aa"}) is None
    assert (cfg.output_dir / rerun.RUN).read_bytes() == before


@pytest.mark.parametrize("change, key, old, new", [
    ({"size": 9}, "size", "8", "9"),
    ({"data": "e.jsonl"}, "data", "'d.jsonl'", "'e.jsonl'"),
])
def test_another_setting_is_refused_in_one_line_naming_both_values(tmp_path, change, key, old, new):
    rerun.prepare(toy(tmp_path), {"data_sha256": "aa"})
    out = tmp_path / "o"
    with pytest.raises(PipelineError) as e:
        rerun.prepare(toy(tmp_path, **change), {"data_sha256": "aa"})
    assert str(e.value) == (f"{out} holds a 99_toy run with {key}={old}; this run has {key}={new}: rerun with the "
                            "same settings to resume, or pass --overwrite to move the old output aside")


def test_an_alias_resumes_only_the_recorded_value_it_names(tmp_path):
    """04's draft_arch recorded as `auto` (before auto was resolved) resumes as what auto meant then:
    the alias (recorded, now) matches that pair only; any other new value is still refused."""
    rerun.prepare(toy(tmp_path), {"data_sha256": "aa"})
    cfg = toy(tmp_path, size=9)
    cfg.record_aliases = {"size": (8, 9)}
    assert rerun.prepare(cfg, {"data_sha256": "aa"}) is None
    other = toy(tmp_path, size=10)
    other.record_aliases = {"size": (8, 9)}
    with pytest.raises(PipelineError, match="size=8; this run has size=10"):
        rerun.prepare(other, {"data_sha256": "aa"})


def test_other_inputs_are_refused_and_another_stage_too(tmp_path):
    rerun.prepare(toy(tmp_path), {"data_sha256": "aa"})
    with pytest.raises(PipelineError, match=r"data_sha256='aa'; this run has data_sha256='bb'"):
        rerun.prepare(toy(tmp_path), {"data_sha256": "bb"})
    with pytest.raises(PipelineError, match="holds a 99_toy run, not a 98_other run"):
        rerun.check(tmp_path / "o", "98_other", {})


def test_overwrite_moves_the_stage_outputs_aside_and_records_the_new_run(tmp_path):
    cfg = toy(tmp_path)
    rerun.prepare(cfg, {"data_sha256": "aa"})
    (cfg.output_dir / "out.jsonl").write_text("{}\n")
    (cfg.output_dir / "manifest.json").write_text("{}")
    (cfg.output_dir / "cache.npy").write_text("kept")  # not one of the outputs: stays
    lines = []
    moved = rerun.prepare(toy(tmp_path, size=9, overwrite=True), {"data_sha256": "bb"}, log=lines.append)
    assert moved is not None and moved.parent == cfg.output_dir and moved.name.startswith("replaced-")
    assert sorted(p.name for p in moved.iterdir()) == ["manifest.json", "out.jsonl", "run.json"]
    assert (cfg.output_dir / "cache.npy").exists() and lines == [f"--overwrite: moved the previous output to {moved}"]
    assert json.loads((cfg.output_dir / rerun.RUN).read_text())["config"]["size"] == 9


def test_outputs_without_a_record_are_refused_and_a_broken_record_named(tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    (out / "out.jsonl").write_text("")  # empty: nothing to protect
    rerun.prepare(toy(tmp_path))
    (out / rerun.RUN).unlink()
    (out / "out.jsonl").write_text("{}\n")
    with pytest.raises(PipelineError, match="has out.jsonl but no run.json: not written by this stage"):
        rerun.prepare(toy(tmp_path))
    (out / rerun.RUN).write_text("{not json")
    with pytest.raises(PipelineError, match="run.json is not a valid run record.*--overwrite"):
        rerun.prepare(toy(tmp_path))
    assert rerun.prepare(toy(tmp_path, overwrite=True)) is not None


def test_a_setting_that_became_resumable_is_not_compared(tmp_path):
    out = tmp_path / "o"
    rerun.check(out, "99_toy", {"data": "d.jsonl", "size": 8, "every": 30.0})  # an older record, `every` then part of it
    assert rerun.prepare(toy(tmp_path)) is None
    long = {"k": "x" * 500}
    rerun.check(tmp_path / "p", "99_toy", long)
    with pytest.raises(PipelineError) as e:
        rerun.check(tmp_path / "p", "99_toy", {"k": "y"})
    assert len(str(e.value)) < 400 and "..." in str(e.value)


def test_a_setting_added_since_the_record_counts_as_its_default(tmp_path):
    out = tmp_path / "o"
    rerun.check(out, "99_toy", {"data": "d.jsonl"})  # recorded before `size` existed
    assert rerun.prepare(toy(tmp_path)) is None  # size left at its default 8: the same run
    with pytest.raises(PipelineError) as e:
        rerun.prepare(toy(tmp_path, size=9))
    assert "size=8; this run has size=9" in str(e.value)
    # an input the record lacks is still a difference
    with pytest.raises(PipelineError, match="data_sha256=None"):
        rerun.prepare(toy(tmp_path), {"data_sha256": "aa"})
