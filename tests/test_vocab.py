"""03_build_vocab_mapping: counts, selection, the d2t/t2d mapping, coverage, reuse, and errors."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from eagle3_train.common import split
from eagle3_train.common.errors import PipelineError, run_main
from eagle3_train.common.manifest import describe_file
from eagle3_train.common.store import read_jsonl
from eagle3_train.common.tokenization import ChatFormat
from eagle3_train.vocab import counts as vocab_counts
from eagle3_train.vocab import coverage as vocab_coverage
from eagle3_train.vocab import mapping as vocab
from helpers import make_training_set, script_path, stage_cli

SCRIPT = script_path("03_build_vocab_mapping")
stage03 = stage_cli("03_build_vocab_mapping")


def make_target(d: Path, tok_dir: Path, vocab_size: int) -> Path:
    """A target directory: a tiny Llama config (no weights: 03 reads only the config) + tokenizer."""
    from transformers import LlamaConfig

    shutil.copytree(tok_dir, d, ignore=shutil.ignore_patterns(".complete"))
    LlamaConfig(vocab_size=vocab_size, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1).save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory, k25_tokenizer_dir):
    return make_training_set(tmp_path_factory.mktemp("tok") / "tokenized", k25_tokenizer_dir, 60)


@pytest.fixture(scope="module")
def ntok(k25_tokenizer):
    return len(k25_tokenizer)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory, k25_tokenizer_dir, ntok):
    # Padded embedding rows, as real targets have: ids past the tokenizer exist but never occur.
    return make_target(tmp_path_factory.mktemp("tgt") / "target", k25_tokenizer_dir, ntok + 60)


def run03(data, target, out, *extra):
    return stage03.main(["--data", str(data), "--target", str(target), "--out", str(out), *map(str, extra)])


def naive_counts(data: Path, v: int, heldout_fraction: float | None = None) -> np.ndarray:
    c = Counter()
    for rec in read_jsonl(Path(data) / "data.jsonl"):
        if heldout_fraction is not None and not split.is_heldout(rec["id"], heldout_fraction):
            continue
        c.update(t for t, m in zip(rec["input_ids"], rec["loss_mask"]) if m)
    out = np.zeros(v, dtype=np.int64)
    for t, n in c.items():
        out[t] = n
    return out


# ----------------------------------------------------------------------------- the stage

def test_round_trip_mapping_counts_and_coverage(tmp_path, data_dir, target_dir, ntok, k25_tokenizer):
    v, k = ntok + 60, 100
    assert run03(data_dir, target_dir, tmp_path / "v", "--draft-vocab-size", k) == 0
    m = vocab.read_mapping(tmp_path / "v")
    assert m.d2t.dtype == np.int64 and m.d2t.shape == (k,)
    assert m.t2d.dtype == np.bool_ and m.t2d.shape == (v,)
    assert int(m.t2d.sum()) == k
    tgt = np.arange(k) + m.d2t  # target = draft + d2t[draft]
    assert np.all(np.diff(tgt) > 0) and tgt[-1] < v and m.t2d[tgt].all()
    assert np.array_equal(np.flatnonzero(m.t2d), tgt)

    # What 04 loads with torch: same dtypes speculators stores.
    import torch
    from safetensors.torch import load_file

    t = load_file(str(tmp_path / "v" / vocab.MAPPING))
    assert t["d2t"].dtype == torch.int64 and t["t2d"].dtype == torch.bool

    # The streaming bincount equals a per-token count; the chosen ids are the top of those counts.
    counts = np.load(tmp_path / "v" / vocab.FREQ)
    expect = naive_counts(data_dir, v)
    assert np.array_equal(counts, expect)
    held = np.load(tmp_path / "v" / vocab.FREQ_HELDOUT)
    assert np.array_equal(held, naive_counts(data_dir, v, 0.1)) and 0 < held.sum() < counts.sum()
    required = {r["id"] for r in m.manifest["required_tokens"]}
    free = [i for i in tgt if i not in required]
    outside = np.flatnonzero(~m.t2d & ~np.isin(np.arange(v), list(required)))
    assert expect[free].min() >= expect[outside].max()

    rep = json.loads((tmp_path / "v" / vocab.COVERAGE_JSON).read_text())
    assert rep["coverage"]["overall"] == pytest.approx(expect[tgt].sum() / expect.sum())
    train_ids = vocab.select_vocab(counts - held, k, required)
    assert rep["coverage"]["heldout"] == pytest.approx(held[train_ids].sum() / held.sum())
    assert 0 < rep["coverage"]["heldout"] <= 1 and rep["supervised_tokens"]["total"] == expect.sum()
    assert any(c["size"] == k for c in rep["curve"]) and len(rep["curve"]) >= 5
    assert (tmp_path / "v" / vocab.COVERAGE_PNG).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    man = m.manifest
    assert man["draft_vocab_size"] == k and man["target_vocab_size"] == v
    assert man["tokenizer"]["fingerprint"] == json.loads((data_dir / "manifest.json").read_text())[
        "tokenizer"]["fingerprint"]
    assert man["inputs"]["data"]["sha256"] == describe_file(data_dir / "data.jsonl")["sha256"]
    assert man["target"]["vocab_size"] == v and man["inputs"]["token_freq"] == "counted"


def test_required_tokens_kept_even_when_rare(tmp_path, data_dir, target_dir, k25_tokenizer):
    k = 12
    assert run03(data_dir, target_dir, tmp_path / "v", "--draft-vocab-size", k,
                 "--keep-tokens", "<|im_system|>") == 0
    m = vocab.read_mapping(tmp_path / "v")
    want = {k25_tokenizer.convert_tokens_to_ids(t): t for t in
            ("<think>", "</think>", "<|im_end|>", "[EOS]", "<|im_system|>")}
    assert all(m.t2d[i] for i in want), want
    req = {r["token"]: r for r in m.manifest["required_tokens"]}
    assert set(req) == set(want.values())
    # [EOS] and <|im_system|> never occur in supervised text: only the rule can have kept them.
    assert req["[EOS]"]["count"] == 0 and not req["[EOS]"]["chosen_by_count_alone"]
    assert req["</think>"]["count"] == 60  # once per sample
    by_count = vocab.select_vocab(np.load(tmp_path / "v" / vocab.FREQ), k)
    assert k25_tokenizer.convert_tokens_to_ids("[EOS]") not in by_count
    assert k25_tokenizer.convert_tokens_to_ids("</think>") not in by_count


def test_no_reasoning_drops_think_tokens_from_the_required_set(k25_tokenizer):
    fmt = ChatFormat.from_tokenizer(k25_tokenizer, reasoning=False)
    roles = [r["role"] for r in vocab.required_tokens(fmt)]
    assert roles == ["end_of_turn", "eos"]
    with pytest.raises(PipelineError, match="not a single token"):
        vocab.required_tokens(fmt, ["not-a-token-string"])


def test_draft_vocab_size_is_clamped_to_the_target(tmp_path, data_dir, target_dir, ntok, capsys):
    v = ntok + 60
    assert run03(data_dir, target_dir, tmp_path / "v") == 0  # default 32000 > 700
    assert f"warning: --draft-vocab-size 32000 exceeds the target vocabulary; using {v}" in capsys.readouterr().err
    m = vocab.read_mapping(tmp_path / "v")
    assert m.draft_vocab_size == v and m.t2d.all() and not m.d2t.any()
    assert m.manifest["config"]["draft_vocab_size"] == 32000 and m.manifest["draft_vocab_size"] == v


def test_frequency_file_reused_and_invalidated(tmp_path, data_dir, target_dir, ntok, capsys):
    data = tmp_path / "tokenized"
    shutil.copytree(data_dir, data)
    out = tmp_path / "v"
    assert run03(data, target_dir, out, "--draft-vocab-size", 50) == 0
    first = np.load(out / vocab.FREQ)

    # Another size in the same output: counts reused, old mapping moved aside, not deleted.
    capsys.readouterr()
    with pytest.raises(PipelineError, match="draft_vocab_size=50.*--overwrite"):
        run03(data, target_dir, out, "--draft-vocab-size", 80)
    assert run03(data, target_dir, out, "--draft-vocab-size", 80, "--overwrite") == 0
    assert "reusing token counts" in capsys.readouterr().out
    assert vocab.read_mapping(out).manifest["inputs"]["token_freq"] == "reused"
    assert vocab.read_mapping(out).draft_vocab_size == 80
    (old,) = out.glob("replaced-*")
    assert (old / vocab.MAPPING).exists() and (old / "manifest.json").exists()

    # Another size in another directory, from these counts: no recount.
    assert run03(data, target_dir, tmp_path / "v2", "--draft-vocab-size", 30, "--freq-from", out) == 0
    assert vocab.read_mapping(tmp_path / "v2").manifest["inputs"]["token_freq"].startswith("copied from")
    assert np.array_equal(np.load(tmp_path / "v2" / vocab.FREQ), first)

    # The input changes: the counts are stale, recounted (with a note), never reused.
    extra = {"id": "extra", "input_ids": [5, 6, 7, 7], "loss_mask": [0, 1, 1, 1]}
    with open(data / "data.jsonl", "a") as f:
        f.write(json.dumps(extra) + "\n")
    capsys.readouterr()
    assert run03(data, target_dir, out, "--draft-vocab-size", 80) == 0
    assert "recounting tokens" in capsys.readouterr().out
    second = np.load(out / vocab.FREQ)
    assert second.sum() == first.sum() + 3 and second[7] == first[7] + 2
    with pytest.raises(PipelineError, match="--freq-from .* does not match this input: input_sha256 changed"):
        run03(data, target_dir, tmp_path / "v3", "--freq-from", tmp_path / "v2")

    # A frequency array that no longer matches its manifest (e.g. a kill between the writes).
    np.save(out / vocab.FREQ, np.zeros_like(second))
    capsys.readouterr()
    assert run03(data, target_dir, out, "--draft-vocab-size", 80) == 0
    assert "does not match its manifest" in capsys.readouterr().out
    assert np.array_equal(np.load(out / vocab.FREQ), second)


def test_malformed_line_in_the_middle_is_named(tmp_path, data_dir, target_dir):
    data = tmp_path / "tokenized"
    shutil.copytree(data_dir, data)
    lines = (data / "data.jsonl").read_text().splitlines(keepends=True)
    lines[3] = lines[3][:40] + "\n"
    (data / "data.jsonl").write_text("".join(lines))
    with pytest.raises(PipelineError, match=r"data.jsonl:4: malformed JSON line"):
        run03(data, target_dir, tmp_path / "v")
    assert not (tmp_path / "v" / "manifest.json").exists() and not (tmp_path / "v" / vocab.FREQ).exists()


# ----------------------------------------------------------------------------- the selection itself

def test_agrees_with_speculators_on_the_same_counts():
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    rng = np.random.default_rng(0)
    v = 3000
    counts = np.zeros(v, dtype=np.int64)
    seen = rng.choice(v, 900, replace=False)
    counts[seen] = rng.zipf(1.3, 900).clip(max=50)  # many ties and many unseen ids
    freq = {int(i): int(counts[i]) for i in np.flatnonzero(counts)}
    for k in (1, 64, 500, 900, 1500, v):  # 1500, v: more than the seen ids, speculators fills
        d2t, t2d = vocab.mappings(vocab.select_vocab(counts, k), v)
        sd2t, st2d = build_vocab_mappings_from_distribution(freq, k, v)
        assert np.array_equal(d2t, sd2t.numpy()) and np.array_equal(t2d, st2d.numpy()), k

    # With required rare ids: the same as speculators given those ids as the most frequent.
    required = [int(np.flatnonzero(counts == 0)[-1]), int(np.argsort(counts, kind="stable")[-300])]
    boosted = {**freq, **{r: int(counts.max()) + 1 for r in required}}
    for k in (2, 64, 500):
        d2t, t2d = vocab.mappings(vocab.select_vocab(counts, k, required), v)
        sd2t, st2d = build_vocab_mappings_from_distribution(boosted, k, v)
        assert np.array_equal(d2t, sd2t.numpy()) and np.array_equal(t2d, st2d.numpy()), k
        assert t2d[required].all()


def test_select_vocab_is_deterministic_and_checks_its_inputs():
    counts = np.array([5, 7, 7, 0, 7, 1])
    assert vocab.select_vocab(counts, 2).tolist() == [1, 2]  # tie on 7: lower ids first
    assert vocab.select_vocab(counts, 3, [3]).tolist() == [1, 2, 3]
    assert vocab.select_vocab(counts, 6).tolist() == list(range(6))
    with pytest.raises(PipelineError, match="smaller than the 2 tokens"):
        vocab.select_vocab(counts, 1, [3, 5])
    with pytest.raises(PipelineError, match="between 1 and the target vocab"):
        vocab.select_vocab(counts, 7)
    d2t, t2d = vocab.mappings([1, 2, 3], 6)
    assert d2t.tolist() == [1, 1, 1] and vocab.check_mappings(d2t, t2d).tolist() == [1, 2, 3]
    t2d[0] = True
    with pytest.raises(PipelineError, match="inconsistent"):
        vocab.check_mappings(d2t, t2d)


def test_coverage_curve_and_size_for_coverage_match_a_direct_computation():
    rng = np.random.default_rng(1)
    choose = rng.zipf(1.5, 400).clip(max=1000).astype(np.int64)
    evaluate = rng.zipf(1.5, 400).clip(max=1000).astype(np.int64)
    req = [399, 7]
    sizes = [2, 3, 10, 100, 400]
    got = vocab_coverage.coverage_curve(choose, evaluate, sizes, req)
    for s, g in zip(sizes, got):
        assert g == pytest.approx(evaluate[vocab.select_vocab(choose, s, req)].sum() / evaluate.sum())
    assert got[-1] == pytest.approx(1.0)
    need = vocab_coverage.size_for_coverage(choose, req, targets=(0.5, 0.9))
    for t, n in need.items():
        cov = lambda k: choose[vocab.select_vocab(choose, k, req)].sum() / choose.sum()  # noqa: E731
        assert cov(n) >= float(t) and (n == len(req) or cov(n - 1) < float(t))


def test_heldout_split_is_fixed_by_id():
    ids = [f"id-{i}" for i in range(4000)]
    a = [split.is_heldout(i, 0.1) for i in ids]
    assert a == [split.is_heldout(i, 0.1) for i in reversed(ids)][::-1]
    assert 300 < sum(a) < 500
    assert not any(split.is_heldout(i, 0.0) for i in ids)


# ----------------------------------------------------------------------------- errors, as a user sees them

def run_script(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True,
                          text=True, timeout=300)


def assert_one_line_error(p: subprocess.CompletedProcess, *needles: str) -> None:
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    assert "Traceback" not in p.stderr
    errs = [ln for ln in p.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errs) == 1, p.stderr
    for n in needles:
        assert n in errs[0], errs[0]


def test_bad_input_errors_are_one_line_with_exit_2(tmp_path, data_dir, target_dir, ntok):
    # Empty input (complete manifest, no records).
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "data.jsonl").write_text("")
    shutil.copy(data_dir / "manifest.json", empty / "manifest.json")
    assert_one_line_error(run_script("--data", empty, "--target", target_dir, "--out", tmp_path / "o1"),
                          "is empty")

    # A directory without a manifest (tokenize did not finish).
    partial = tmp_path / "partial"
    partial.mkdir()
    shutil.copy(data_dir / "data.jsonl", partial / "data.jsonl")
    assert_one_line_error(run_script("--data", partial, "--target", target_dir, "--out", tmp_path / "o2"),
                          "no manifest.json", "tokenize")

    # A token id the target does not have.
    bad = tmp_path / "bad"
    shutil.copytree(data_dir, bad)
    v = ntok + 60
    with open(bad / "data.jsonl", "a") as f:
        f.write(json.dumps({"id": "oops", "input_ids": [1, v, 2], "loss_mask": [0, 1, 1]}) + "\n")
    out3 = tmp_path / "o3"
    assert_one_line_error(run_script("--data", bad, "--target", target_dir, "--out", out3),
                          "record oops", f"token id {v}", f"(0..{v - 1})")
    assert not (out3 / "manifest.json").exists() and not (out3 / vocab.MAPPING).exists()



def test_tokenizer_target_mismatch_is_one_line_with_exit_2(tmp_path, data_dir, k25_tokenizer_dir,
                                                         thinking_first_tokenizer_dir, ntok, capsys):
    # In-process through run_main (what `python 03_...py` calls), to spare two interpreter starts.
    def one_line_error(*args) -> str:
        capsys.readouterr()
        assert run_main(stage03.main, [str(a) for a in args]) == 2
        errs = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error: ")]
        assert len(errs) == 1
        return errs[0]

    # A target whose vocabulary is smaller than the tokenizer's.
    small = make_target(tmp_path / "small-target", k25_tokenizer_dir, ntok - 100)
    err = one_line_error("--data", data_dir, "--target", small, "--out", tmp_path / "o4")
    assert "tokenizer/target mismatch" in err and f"has {ntok} tokens" in err
    assert f"vocab_size {ntok - 100}" in err

    # A target that ships another tokenizer than the one the data was made with.
    other = make_target(tmp_path / "other-target", thinking_first_tokenizer_dir, ntok + 60)
    err = one_line_error("--data", data_dir, "--target", other, "--out", tmp_path / "o5")
    assert "tokenizer fingerprint mismatch" in err and str(k25_tokenizer_dir) in err
    assert not (tmp_path / "o4").exists() and not (tmp_path / "o5").exists()  # refused before writing


def test_supervised_ids_checks_each_record():
    rec = {"id": "r", "input_ids": [3, 4, 5, 4], "loss_mask": [0, 1, 0, 1]}
    assert vocab_counts.supervised_ids(rec, 6, "f").tolist() == [4, 4]
    for bad, msg in ((dict(rec, loss_mask=[0, 1]), "4 input_ids but 2 loss_mask"),
                     (dict(rec, loss_mask=[0, -1, 0, 1]), "other than 0/1"),
                     (dict(rec, loss_mask=[0, 2, 0, 1]), "other than 0/1"),
                     (dict(rec, input_ids=[3, "x", 5, 4]), "non-integer input id"),
                     (dict(rec, input_ids=[3, 4, -1, 4]), "token id -1 outside"),
                     (dict(rec, input_ids=[3, 4, 6, 4]), r"token id 6 outside the target vocabulary \(0..5\)"),
                     ({"id": "r", "input_ids": [1]}, "no 'loss_mask'")):
        with pytest.raises(PipelineError, match=msg):
            vocab_counts.supervised_ids(bad, 6, "f")


def test_a_crash_while_rewriting_leaves_no_complete_claim(tmp_path, data_dir, target_dir, monkeypatch):
    out = tmp_path / "v"
    assert run03(data_dir, target_dir, out, "--draft-vocab-size", 40) == 0

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(vocab_coverage, "plot_coverage", boom)
    # different settings + --overwrite: the old output is moved aside, the new one dies half-written
    with pytest.raises(KeyboardInterrupt):
        run03(data_dir, target_dir, out, "--draft-vocab-size", 48, "--overwrite")
    with pytest.raises(PipelineError, match="incomplete"):
        vocab.read_mapping(out)
    kept = [p for p in out.glob("replaced-*") if (p / "manifest.json").exists()]
    assert len(kept) == 1 and vocab.read_mapping(kept[0]).draft_vocab_size == 40
    monkeypatch.undo()
    assert run03(data_dir, target_dir, out, "--draft-vocab-size", 48) == 0
    assert vocab.read_mapping(out).draft_vocab_size == 48


def test_rerun_of_a_complete_output_changes_nothing(tmp_path, k25_tokenizer_dir):
    """A finished 03 rerun with the same command is a no-op: the manifest (which 04 checks) stays."""
    data = make_training_set(tmp_path / "tok", k25_tokenizer_dir, n=12, seed=5)
    target = make_target(tmp_path / "target", k25_tokenizer_dir, 600)
    argv = ["--data", str(data), "--target", str(target), "--out", str(tmp_path / "v"), "--draft-vocab-size", "64"]
    assert stage03.main(argv) == 0
    before = (tmp_path / "v" / "manifest.json").read_bytes()
    assert stage03.main(argv) == 0
    assert (tmp_path / "v" / "manifest.json").read_bytes() == before
