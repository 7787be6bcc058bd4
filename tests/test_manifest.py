"""eagle3_train.common.manifest, directly: a manifest is written last and atomically, read back only when
complete and of the expected stage, its identity ignores when/how it was written, and a mismatch
is one line naming both values."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from eagle3_train.common.errors import PipelineError
from eagle3_train.common.manifest import (
    MANIFEST,
    VOLATILE_KEYS,
    manifest_identity,
    manifest_of_file,
    read_manifest,
    require_match,
    tokenizer_fingerprint,
    write_manifest,
)


def test_write_manifest_records_the_run_and_is_read_back(tmp_path):
    (tmp_path / ".tmp-manifest.json.dead").write_text('{"stage": "x", "compl')  # an earlier kill's
    written = write_manifest(tmp_path, "03_build_vocab_mapping", config={"k": 8}, counts={"n": 3},
                             inputs={"data": {"sha256": "ab"}}, target={"model_type": "llama"})
    assert sorted(p.name for p in tmp_path.iterdir()) == [MANIFEST]
    got = read_manifest(tmp_path, "03_build_vocab_mapping")
    assert got == json.loads(json.dumps(written, default=str))
    assert got["complete"] is True and got["config"] == {"k": 8} and got["counts"] == {"n": 3}
    assert got["inputs"] == {"data": {"sha256": "ab"}} and got["outputs"] == {}
    assert got["target"] == {"model_type": "llama"}
    assert set(VOLATILE_KEYS) <= set(got)


def test_read_manifest_refuses_what_is_not_a_complete_output_of_the_stage(tmp_path):
    with pytest.raises(PipelineError, match="does not exist"):
        read_manifest(tmp_path / "absent")
    with pytest.raises(PipelineError, match=r"incomplete \(no manifest.json\): stage 02_x did not finish"):
        read_manifest(tmp_path, "02_x")
    (tmp_path / MANIFEST).write_text('{"stage": ')
    with pytest.raises(PipelineError, match="is not valid JSON"):
        read_manifest(tmp_path)
    write_manifest(tmp_path, "02_x", config={})
    with pytest.raises(PipelineError, match="holds the output of '02_x', expected '03_y'"):
        read_manifest(tmp_path, "03_y")
    m = json.loads((tmp_path / MANIFEST).read_text())
    (tmp_path / MANIFEST).write_text(json.dumps({**m, "complete": False}))
    with pytest.raises(PipelineError, match="not marked complete"):
        read_manifest(tmp_path, "02_x")


def test_manifest_of_file_reads_the_directory_it_lives_in(tmp_path):
    write_manifest(tmp_path, "s", config={"a": 1})
    assert manifest_of_file(tmp_path / "data.jsonl", "s")["config"] == {"a": 1}


def test_manifest_identity_ignores_when_and_how_it_was_written(tmp_path):
    write_manifest(tmp_path, "s", config={"a": 1}, counts={"n": 2})
    before = manifest_identity(tmp_path, "s")
    m = json.loads((tmp_path / MANIFEST).read_text())
    rerun = {**m, "created": "2099-01-01T00:00:00+00:00", "command": ["other"], "git_sha": "f00", "pid": 1}
    (tmp_path / MANIFEST).write_text(json.dumps(rerun))
    assert manifest_identity(tmp_path, "s") == before
    (tmp_path / MANIFEST).write_text(json.dumps({**rerun, "counts": {"n": 3}}))
    assert manifest_identity(tmp_path, "s") != before
    (tmp_path / MANIFEST).write_text(json.dumps({**m, "config": {"a": 2}}))
    assert manifest_identity(tmp_path, "s") != before


def test_require_match_names_both_values_in_one_line():
    require_match("tokenizer", "abc", "abc", source="/data")
    with pytest.raises(PipelineError) as e:
        require_match("tokenizer", "abc", "xyz", source="/data")
    assert str(e.value) == "tokenizer mismatch: /data was made with 'xyz', but this run uses 'abc'"


class _Tok:
    def __init__(self, vocab, template):
        self._vocab, self.chat_template, self.all_special_tokens = vocab, template, ["<s>"]

    def get_vocab(self):
        return dict(self._vocab)


def test_tokenizer_fingerprint_follows_vocabulary_and_chat_template():
    a = tokenizer_fingerprint(_Tok({"a": 0, "b": 1}, "{{ x }}"))
    assert a == tokenizer_fingerprint(_Tok({"b": 1, "a": 0}, "{{ x }}"))  # the dict's order is not identity
    assert a != tokenizer_fingerprint(_Tok({"a": 0, "b": 2}, "{{ x }}"))
    assert a != tokenizer_fingerprint(_Tok({"a": 0, "b": 1}, "{{ y }}"))
    assert len(a) == 16 and isinstance(tokenizer_fingerprint(_Tok({}, None)), str)


def test_write_manifest_goes_through_an_atomic_write(tmp_path, monkeypatch):
    """A kill while the manifest is written leaves the old one or none, never half of one."""
    from eagle3_train.common import store

    write_manifest(tmp_path, "s", config={"v": 1})

    def killed(fd):
        raise KeyboardInterrupt

    monkeypatch.setattr(store.os, "fsync", killed)
    with pytest.raises(KeyboardInterrupt):
        write_manifest(tmp_path, "s", config={"v": 2})
    monkeypatch.undo()
    assert read_manifest(Path(tmp_path), "s")["config"] == {"v": 1}
