"""Kimi-K2.5-specific bad inputs (the catalogue's style: one `error:` line naming what is wrong,
exit 2, nothing already there changed): the remote-code tokenizer's .py file missing, a wrapper
config without `text_config`, a target whose vocabulary is smaller than its tokenizer's."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from reliability import assert_one_error_line, assert_unchanged, run_inprocess, snapshot


@pytest.fixture(scope="module")
def twin_tokset(kimi_random_twin_dir, tmp_path_factory):
    from eagle3_testkit.fixtures import synthetic_training_set

    return synthetic_training_set(tmp_path_factory.mktemp("kimi") / "tok", kimi_random_twin_dir, n=6, seed=3)


def broken_twin(src: Path, dst: Path, *, drop: str | None = None, config=None) -> Path:
    """A copy of the twin (big files linked) with one file left out or its config edited."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name == drop or f.name.startswith("."):
            continue
        if f.suffix in (".safetensors", ".model"):
            os.symlink(f, dst / f.name)
        else:
            (dst / f.name).write_bytes(f.read_bytes())
    if config:
        raw = json.loads((dst / "config.json").read_text())
        config(raw)
        (dst / "config.json").write_text(json.dumps(raw))
    return dst


def refused(res, inputs: list[Path], out: Path | None, *needles) -> str:
    line = assert_one_error_line(res, *needles)
    for d, before in inputs:
        assert_unchanged(before, d, allow_new=lambda rel: False)
    if out is not None:
        assert not (out / "manifest.json").exists()
    return line


def test_remote_code_tokenizer_file_missing(tmp_path, capfd, kimi_random_twin_dir, twin_tokset):
    bad = broken_twin(kimi_random_twin_dir, tmp_path / "twin", drop="tokenization_kimi.py")
    keep = [(twin_tokset, snapshot(twin_tokset)), (bad, snapshot(bad))]
    out = tmp_path / "h"
    res = run_inprocess("02_extract_hidden_states", ["--input", twin_tokset, "--model", bad, "--output-dir", out], capfd)
    refused(res, keep, out, "tokenizer", str(bad), "tokenization_kimi")


def test_wrapper_config_without_text_config(tmp_path, capfd, kimi_random_twin_dir, twin_tokset):
    bad = broken_twin(kimi_random_twin_dir, tmp_path / "twin", config=lambda c: c.pop("text_config"))
    keep = [(twin_tokset, snapshot(twin_tokset))]
    for script, argv, out in (
            ("02_extract_hidden_states", ["--input", twin_tokset, "--model", bad, "--output-dir", tmp_path / "h"],
             tmp_path / "h"),
            ("03_build_vocab_mapping", ["--data", twin_tokset, "--target", bad, "--output-dir", tmp_path / "v",
                                        "--draft-vocab-size", 64], tmp_path / "v")):
        res = run_inprocess(script, argv, capfd)
        refused(res, keep, out, "text_config", "kimi_k25", str(bad / "config.json"))


def test_target_vocab_smaller_than_its_tokenizer(tmp_path, capfd, kimi_random_twin_dir, twin_tokset):
    # e.g. a text_config copied from a model without Kimi's 256 special ids
    bad = broken_twin(kimi_random_twin_dir, tmp_path / "twin",
                      config=lambda c: c["text_config"].update(vocab_size=163584))
    keep = [(twin_tokset, snapshot(twin_tokset))]
    out = tmp_path / "h"
    res = run_inprocess("02_extract_hidden_states", ["--input", twin_tokset, "--model", bad, "--output-dir", out], capfd)
    refused(res, keep, out, "163584", "163840", "vocabulary")
