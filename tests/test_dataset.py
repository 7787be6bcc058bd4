"""The tokenize step (01b --tokenize / 01c): raw answers -> training JSONL, with every drop counted."""

from __future__ import annotations

import json

import pytest
from eagle3_testkit.tiny import synthetic_examples
from eagle3_train.common.errors import PipelineError
from eagle3_train.common.manifest import describe_file, tokenizer_fingerprint, write_manifest
from eagle3_train.common.store import JsonlWriter, file_sha256
from eagle3_train.common.tokenization import ChatFormat
from eagle3_train.generate.stage import STAGE as GEN_STAGE
from eagle3_train.tokenize.dataset import DATA, TrainingSet, build_training_set


@pytest.fixture(scope="module")
def fmt(k25_tokenizer):
    return ChatFormat.from_tokenizer(k25_tokenizer)


def answer(fmt, i, ex, finish="stop"):
    """A record as 01b stores it, with the ids the target itself would have returned."""
    tok = fmt.tokenizer
    msgs = [{"role": "user", "content": ex["question"]}]
    prompt = fmt.render(msgs, add_generation_prompt=True)
    gen = tok.encode(ex["reasoning"], add_special_tokens=False)
    content = None
    if finish == "stop":
        content = ex["answer"]
        gen += [fmt.think_end_id] + tok.encode(content, add_special_tokens=False) + [fmt.end_of_turn_id]
    return {"id": f"s{i:03d}", "messages": msgs, "reasoning": ex["reasoning"], "content": content,
            "prompt_token_ids": prompt, "token_ids": gen, "finish_reason": finish}


def raw_dir(tmp_path, records, complete=True):
    d = tmp_path / "gen"
    with JsonlWriter(d / "raw_responses.jsonl") as w:
        for r in records:
            w.write(r)
    if complete:
        finish_raw(d, len(records))
    return d


def finish_raw(d, n):
    """The manifest 01b writes last: raw_responses.jsonl as it finished (size, sha256, records)."""
    write_manifest(d, GEN_STAGE, config={"model": "tiny"}, counts={"records_in_file": n},
                   outputs={"raw_responses": describe_file(d / "raw_responses.jsonl")}, target={"model": "tiny"})


@pytest.fixture
def records(fmt):
    exs = synthetic_examples(8, seed=3)
    recs = [answer(fmt, i, ex) for i, ex in enumerate(exs)]
    recs[5] = answer(fmt, 5, exs[5], finish="length")
    return recs


def test_ids_path_is_kept_and_counts_add_up(tmp_path, fmt, records, capsys):
    d = raw_dir(tmp_path, records)
    m = build_training_set(d, d / "tokenized", fmt, tokenizer_name="k25")
    ts = TrainingSet(d / "tokenized")
    got = list(ts)
    assert [r["id"] for r in got] == [r["id"] for r in records]
    for rec, raw in zip(got, records):
        assert rec["input_ids"] == raw["prompt_token_ids"] + raw["token_ids"]  # path (a), exactly
        assert rec["loss_mask"] == [0] * len(raw["prompt_token_ids"]) + [1] * len(raw["token_ids"])
        assert rec["stats"]["mismatch"] is None and rec["stats"]["source"] == "token_ids"
    c = m["counts"]
    assert (c["samples"], c["input_records"], c["mismatched"], c["kept_length"], c["dropped_length"]) == (8, 8, 0, 1, 0)
    assert c["finish_reasons"] == {"stop": 7, "length": 1}
    assert m["tokenizer"]["fingerprint"] == tokenizer_fingerprint(fmt.tokenizer)
    assert m["chat_format"] == fmt.describe()
    assert m["inputs"]["raw_responses"]["sha256"] == file_sha256(d / "raw_responses.jsonl")
    assert "tokenize: 8 samples" in capsys.readouterr().out


def test_mismatch_is_reported_with_both_sides(tmp_path, fmt, records, capsys):
    bad = records[2]
    bad["token_ids"][3] = (bad["token_ids"][3] + 1) % len(fmt.tokenizer)  # ids disagree with the text
    d = raw_dir(tmp_path, records)
    m = build_training_set(d, d / "tokenized", fmt, tokenizer_name="k25")
    assert m["counts"]["mismatched"] == 1
    ex = m["mismatch_examples"][0]
    assert ex["id"] == bad["id"] and ex["count"] == 1 and not ex["in_prompt"]
    assert ex["first"] == len(bad["prompt_token_ids"]) + 3 and ex["ids_side"] != ex["text_side"]
    rec = next(r for r in TrainingSet(d / "tokenized") if r["id"] == bad["id"])
    assert rec["input_ids"] == bad["prompt_token_ids"] + bad["token_ids"]  # (a) kept, and flagged
    assert rec["stats"]["mismatch"]["count"] == 1 and rec["stats"]["mismatch"]["kind"] == "real"
    assert m["counts"]["mismatch_kinds"] == {"real": 1} and "real" in m["mismatch_causes"]
    out = capsys.readouterr().out
    assert f"mismatch {bad['id']} (real)" in out and "warning: 1 real mismatches" in out


def test_parser_stripped_whitespace_is_counted_apart_from_real_mismatches(tmp_path, fmt, records, capsys):
    # The letter-count task ends its reasoning with "\n"; a kimi_k2-like parser returns it stripped.
    stripped = [r for r in records if r["reasoning"].endswith("\n") and r["finish_reason"] == "stop"]
    assert len(stripped) >= 2
    for r in stripped:
        r["reasoning"] = r["reasoning"].rstrip()
    bad = next(r for r in records if r not in stripped and r["finish_reason"] == "stop")
    bad["token_ids"][2] = (bad["token_ids"][2] + 1) % len(fmt.tokenizer)
    d = raw_dir(tmp_path, records)
    m = build_training_set(d, d / "tokenized", fmt, tokenizer_name="k25")
    c = m["counts"]
    assert c["mismatched"] == len(stripped) + 1
    assert c["mismatch_kinds"] == {"boundary_whitespace": len(stripped), "real": 1}
    assert set(m["mismatch_causes"]) == {"boundary_whitespace", "real"}
    kinds = {e["id"]: e["kind"] for e in m["mismatch_examples"]}
    assert kinds == {**{r["id"]: "boundary_whitespace" for r in stripped}, bad["id"]: "real"}
    for rec in TrainingSet(d / "tokenized"):  # the returned ids are what is trained on, either way
        raw = next(r for r in records if r["id"] == rec["id"])
        assert rec["input_ids"] == raw["prompt_token_ids"] + raw["token_ids"]
    out = capsys.readouterr().out
    assert f"mismatched {len(stripped) + 1} (returned ids vs re-wrapped text: 1 real, {len(stripped)} boundary" in out
    assert "warning: 1 real mismatches" in out
    assert out.index(f"mismatch {bad['id']} (real)") < out.index("(boundary_whitespace)")  # real ones first


def test_explained_kinds_are_not_real_and_malformed_answers_are_an_answer_quality_figure(tmp_path, fmt, records,
                                                                                        capsys):
    # The three kinds 01c once cried wolf about on 2,000 real answers, one each, beside clean ones.
    tok = fmt.tokenizer
    odd = next(r for r in records if r["finish_reason"] == "stop")
    words = tok.encode(odd["reasoning"], add_special_tokens=False)
    spelled = [i for ch in odd["reasoning"] for i in tok.encode(ch, add_special_tokens=False)]
    assert spelled != words
    odd["token_ids"] = spelled + odd["token_ids"][len(words):]  # same text, other split
    open_end = next(r for r in records if r["finish_reason"] == "stop" and r is not odd)
    open_end["token_ids"] = [t for t in open_end["token_ids"] if t != fmt.think_end_id]  # never closed
    open_end["reasoning"], open_end["content"] = tok.decode(open_end["token_ids"][:-1]), None
    d = raw_dir(tmp_path, records)
    m = build_training_set(d, d / "tokenized", fmt, tokenizer_name="k25")
    c = m["counts"]
    assert c["mismatch_kinds"] == {"same_text": 1, "malformed": 1}
    assert c["malformed"] == 1 and c["malformed_reasons"] == {"end of turn with the reasoning never closed": 1}
    rec = {r["id"]: r for r in TrainingSet(d / "tokenized")}
    assert rec[open_end["id"]]["stats"]["malformed"] and rec[odd["id"]]["stats"]["malformed"] is None
    out = capsys.readouterr().out
    assert "real mismatches" not in out and "0 real, 0 boundary whitespace, 1 same text" in out
    assert (f"answer quality: 1 of {len(records)} answers malformed (1 end of turn with the reasoning never "
            "closed)") in out


def test_drop_length_truncation_and_no_supervised_tokens(tmp_path, fmt, records):
    long_prompt = answer(fmt, 99, {"question": "word " * 300, "reasoning": "r", "answer": "a"})
    d = raw_dir(tmp_path, records + [long_prompt])
    m = build_training_set(d, d / "tok", fmt, tokenizer_name="k25", max_seq_len=64, keep_length=False)
    c = m["counts"]
    assert c["dropped_length"] == 1 and c["kept_length"] == 0
    assert c["dropped_no_supervised_tokens"] == 1  # its prompt alone fills max_seq_len
    assert c["samples"] == 7 and c["truncated"] >= 1
    assert all(len(r["input_ids"]) <= 64 and sum(r["loss_mask"]) > 0 for r in TrainingSet(d / "tok"))
    ids = [r["id"] for r in TrainingSet(d / "tok")]
    assert records[5]["id"] not in ids and "s099" not in ids


def test_up_to_date_output_is_not_rebuilt_but_a_changed_input_is(tmp_path, fmt, records, capsys):
    d = raw_dir(tmp_path, records[:4])
    build_training_set(d, d / "tok", fmt, tokenizer_name="k25")
    mtime = (d / "tok" / DATA).stat().st_mtime_ns
    capsys.readouterr()
    build_training_set(d, d / "tok", fmt, tokenizer_name="k25")
    assert "up to date" in capsys.readouterr().out and (d / "tok" / DATA).stat().st_mtime_ns == mtime
    with JsonlWriter(d / "raw_responses.jsonl") as w:  # a resumed 01b: one more answer, a new manifest
        w.write(records[4])
    finish_raw(d, 5)
    m = build_training_set(d, d / "tok", fmt, tokenizer_name="k25")
    assert m["counts"]["samples"] == 5


def test_refuses_an_incomplete_generation(tmp_path, fmt, records):
    d = raw_dir(tmp_path, records, complete=False)
    with pytest.raises(PipelineError, match="incomplete.*01b"):
        build_training_set(d, d / "tok", fmt, tokenizer_name="k25")


def test_another_tokenizer_is_one_error_line(tmp_path, fmt, records):
    records[0]["token_ids"].append(10_000)  # an id the tiny vocabulary cannot have
    d = raw_dir(tmp_path, records)
    with pytest.raises(PipelineError, match="outside the tokenizer's vocabulary"):
        build_training_set(d, d / "tok", fmt, tokenizer_name="k25")
    assert not (d / "tok" / DATA).exists() and not list((d / "tok").glob(".tmp-*"))


def test_01c_cli(tmp_path, fmt, records, k25_tokenizer_dir, capsys):
    from eagle3_train.common.errors import run_main
    from helpers import stage_cli

    main = stage_cli("01c_tokenize").main
    d = raw_dir(tmp_path, records)
    assert run_main(main, ["--raw-dir", str(d), "--tokenizer", str(k25_tokenizer_dir), "--drop-length"]) == 0
    assert "dropped: length 1" in capsys.readouterr().out
    m = json.loads((d / "tokenized" / "manifest.json").read_text())
    assert m["stage"] == "01c_tokenize" and m["counts"]["samples"] == 7
    assert run_main(main, ["--raw-dir", str(tmp_path / "nope"), "--tokenizer", str(k25_tokenizer_dir)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "does not exist" in err


@pytest.mark.parametrize("change", ["torn-last-line", "appended-record"])
def test_01c_refuses_a_raw_file_changed_after_01b_finished(tmp_path, fmt, records, k25_tokenizer_dir, capsys, change):
    """01b's manifest records raw_responses.jsonl's size and hash: a torn last line (once skipped
    quietly, the sample lost, exit 0) or a record added after it finished is one error line, and
    the tokenized set made before stays as it was."""
    from eagle3_train.common.errors import run_main
    from helpers import stage_cli

    main = stage_cli("01c_tokenize").main
    d = raw_dir(tmp_path, records)
    argv = ["--raw-dir", str(d), "--tokenizer", str(k25_tokenizer_dir)]
    assert run_main(main, argv) == 0
    raw = d / "raw_responses.jsonl"
    if change == "torn-last-line":
        raw.write_bytes(raw.read_bytes()[:-40])
    else:
        with open(raw, "a") as f:
            f.write(json.dumps({**records[0], "id": "extra"}) + "\n")
    before = {p: p.read_bytes() for p in d.rglob("*") if p.is_file() and p.name != ".lock"}
    capsys.readouterr()
    assert run_main(main, argv) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert f"{raw} does not match its manifest (8 records" in lines[0]
    assert "changed after 01b finished; rerun 01b to repair it" in lines[0]
    assert {p: p.read_bytes() for p in d.rglob("*") if p.is_file() and p.name != ".lock"} == before


# ----------------------------------------------------------------------------- --max-seq-len's default

def test_max_seq_len_resolves_to_what_01b_can_return():
    from eagle3_train.tokenize.config import FALLBACK_SEQ_LEN, resolve_max_seq_len

    def resolve(given=None, **kw):
        return resolve_max_seq_len(given, **{"longest_prompt": 900, "max_tokens": 16384, "max_model_len": 32768, **kw})

    assert resolve() == (17284, "longest prompt + --max-tokens", None)  # the runbook's 16384 answers stay whole
    assert resolve(max_tokens=None) == (32768, "server max_model_len", None)
    value, source, note = resolve(max_tokens=None, max_model_len=None)
    assert (value, source) == (FALLBACK_SEQ_LEN, "fallback") == (8192, "fallback") and note.startswith("note: ")
    assert resolve(4096) == (4096, "given", None)
    value, source, note = resolve(recorded=8192)  # built before the default was resolved: resumes as it ran
    assert (value, source) == (8192, "recorded") and "as this set was built" in note


def test_unset_max_seq_len_keeps_every_answer_whole_and_is_recorded(tmp_path, fmt, records, capsys):
    d = raw_dir(tmp_path, records)
    most = max(len(r["token_ids"]) for r in records)  # --max-tokens: no answer is longer
    write_manifest(d, GEN_STAGE, config={"model": "tiny", "max_tokens": most}, counts={"records_in_file": len(records)},
                   outputs={"raw_responses": describe_file(d / "raw_responses.jsonl")}, target={"model": "tiny"})
    longest = max(len(r["prompt_token_ids"]) for r in records)
    m = build_training_set(d, d / "tok", fmt, tokenizer_name="k25")
    assert m["config"]["max_seq_len"] == longest + most
    assert m["config"]["max_seq_len_from"] == "longest prompt + --max-tokens"
    assert m["counts"]["truncated"] == 0 and "warning" not in capsys.readouterr().out
    # given below prompt + --max-tokens: one warning line with what it cut
    m = build_training_set(d, d / "tok2", fmt, tokenizer_name="k25", max_seq_len=longest + 2)
    warned = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning: --max-seq-len")]
    cut = m["counts"]["truncated"]
    assert cut > 0 and len(warned) == 1
    assert f": {cut} of {len(records)} answers cut to fit, 0 of them dropped" in warned[0], warned


def test_a_set_built_at_the_old_default_resumes_as_it_was_built(tmp_path, fmt, records, capsys):
    d = raw_dir(tmp_path, records[:4])
    m = build_training_set(d, d / "tok", fmt, tokenizer_name="k25", max_seq_len=8192)
    old = {**m, "config": {k: v for k, v in m["config"].items() if k != "max_seq_len_from"}}
    (d / "tok" / "manifest.json").write_text(json.dumps(old))  # as the earlier code wrote it
    mtime = (d / "tok" / DATA).stat().st_mtime_ns
    capsys.readouterr()
    build_training_set(d, d / "tok", fmt, tokenizer_name="k25")  # a bare rerun: same key, not rebuilt
    out = capsys.readouterr().out
    assert "--max-seq-len 8,192, as this set was built" in out and "up to date" in out, out
    assert (d / "tok" / DATA).stat().st_mtime_ns == mtime


def test_without_max_tokens_the_servers_context_is_the_cut(tmp_path, fmt, records, capsys):
    d = raw_dir(tmp_path, records[:4])
    write_manifest(d, GEN_STAGE, config={"model": "tiny", "max_tokens": None}, counts={"records_in_file": 4},
                   outputs={"raw_responses": describe_file(d / "raw_responses.jsonl")}, target={"model": "tiny"},
                   this_run={"server_cache": {"endpoints": {"http://a/v1": {"max_model_len": 4096},
                                                            "http://b/v1": {"note": "no metrics"}}}})
    assert build_training_set(d, d / "tok", fmt, tokenizer_name="k25")["config"]["max_seq_len"] == 4096
    d2 = raw_dir(tmp_path / "bare", records[:4])  # nothing recorded: 8192, noted
    assert build_training_set(d2, d2 / "tok", fmt, tokenizer_name="k25")["config"]["max_seq_len"] == 8192
    assert "note: --max-seq-len 8192: 01b recorded no --max-tokens" in capsys.readouterr().out
