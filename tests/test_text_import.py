"""Text-only answers: 01a imports them into a 01b-format directory, and 01b --allow-text-fallback
re-wraps answers a server sent without ids; both marked text-derived all the way down."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from eagle3_train.common.store import TMP_PREFIX
from eagle3_train.tokenize.dataset import TrainingSet
from helpers_generate import REPO, TOKENIZE, FaultServer, env, read_records, run_gen, write_prompts

IMPORT = REPO / "eagle3-train" / "01a_import_text.py"
VOCAB = REPO / "eagle3-train" / "03_build_vocab_mapping.py"
ANSWERS = [
    {"id": "a", "messages": [{"role": "user", "content": "What is 12 + 30?"}],
     "reasoning": "I add 12 and 30 digit by digit.", "content": "The answer is 42."},
    {"id": "b", "prompt": "How many times does p appear in apple?",
     "reasoning": "I check each letter of apple for p. I found 2.\n", "content": "p appears 2 times."},
    {"conversations": [{"from": "human", "value": "Say hi"}, {"from": "gpt", "value": "old answer"}],
     "content": "hi"},
    {"id": "d", "messages": [{"role": "user", "content": "Sort these numbers: 3 1"}],
     "reasoning": "I sort 3 1 by taking", "finish_reason": "length"},
]


def write_answers(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def run(script, *args):
    return subprocess.run([sys.executable, str(script), *map(str, args)], capture_output=True, text=True,
                          env=env(), timeout=300)


def by_hand(tok, messages, reasoning, content, finish="stop"):
    """The re-wrap built without the module: the template, then each piece encoded on its own."""
    prompt = list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))
    enc = lambda t: tok.encode(t, add_special_tokens=False) if t else []  # noqa: E731
    gen = enc(reasoning)
    if finish == "stop":
        gen += [tok.convert_tokens_to_ids("</think>")] + enc(content) + [tok.convert_tokens_to_ids("<|im_end|>")]
    return prompt, gen


def assert_one_error_line(res, *needles):
    assert res.returncode == 2, (res.stdout, res.stderr)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def test_import_writes_a_complete_text_marked_01b_directory(tmp_path, k25_tokenizer_dir, k25_tokenizer):
    out = tmp_path / "gen"
    res = run(IMPORT, "--input", write_answers(tmp_path / "a.jsonl", ANSWERS), "--output-dir", out,
              "--tokenizer", k25_tokenizer_dir)
    assert res.returncode == 0, res.stderr
    warn = [ln for ln in res.stdout.splitlines() if ln.startswith("warning:")]
    assert len(warn) == 1 and "4 of 4 answers have text-derived ids" in warn[0]
    assert "exact tokenization" in warn[0] and "stripped" in warn[0] and "special tokens" in warn[0]
    recs = read_records(out / "raw_responses.jsonl")
    assert [r["id"] for r in recs[:2]] == ["a", "b"] and recs[3]["id"] == "d" and recs[2]["id"].startswith("h")
    assert all(r["source"] == "text" for r in recs)
    assert recs[2]["messages"] == [{"role": "user", "content": "Say hi"}]  # the old answer is not the prompt
    for r in recs:
        assert (r["prompt_token_ids"], r["token_ids"]) == by_hand(k25_tokenizer, r["messages"], r.get("reasoning"),
                                                                  r.get("content"), r["finish_reason"])
    m = json.loads((out / "manifest.json").read_text())
    assert m["stage"] == "01b_generate_synthetic" and m["written_by"] == "01a_import_text" and m["complete"]
    assert m["source"] == "text" and m["text_derived"] is True
    c = m["counts"]
    assert (c["answered"], c["failed"], c["records_in_file"], c["text_derived"]) == (4, 0, 4, 4)
    assert c["finish_reasons"] == {"stop": 3, "length": 1}
    assert c["generated_tokens"] == sum(len(r["token_ids"]) for r in recs)
    assert m["config"]["tokenizer"] == str(k25_tokenizer_dir) and "text cannot restore" in m["text_warning"]


def test_downstream_stages_take_it_and_keep_the_text_flag(tmp_path, k25_tokenizer_dir, llama_target_dir):
    out = tmp_path / "gen"
    assert run(IMPORT, "--input", write_answers(tmp_path / "a.jsonl", ANSWERS), "--output-dir", out,
               "--tokenizer", k25_tokenizer_dir).returncode == 0
    tok = run(TOKENIZE, "--raw-dir", out)  # the tokenizer comes from 01a's manifest, as from 01b's
    assert tok.returncode == 0, tok.stderr
    ts = TrainingSet(out / "tokenized")
    raw = {r["id"]: r for r in read_records(out / "raw_responses.jsonl")}
    assert ts.manifest["text_derived"] is True
    c = ts.manifest["counts"]
    assert c["text_derived"] == 4 and c["sources"] == {"text": 4} and c["mismatched"] == 0
    for rec in ts:
        assert rec["stats"]["source"] == "text"
        assert rec["input_ids"] == raw[rec["id"]]["prompt_token_ids"] + raw[rec["id"]]["token_ids"]
    assert "warning: 4 samples are text-derived" in tok.stdout
    voc = run(VOCAB, "--data", out / "tokenized", "--target", llama_target_dir, "--tokenizer", k25_tokenizer_dir,
              "--out", tmp_path / "vocab", "--draft-vocab-size", "64")
    assert voc.returncode == 0, voc.stderr
    assert json.loads((tmp_path / "vocab" / "manifest.json").read_text())["text_derived"] is True
    assert "text-derived" in voc.stdout


@pytest.mark.parametrize("bad, needles", [
    ({"id": "x", "messages": [{"role": "user", "content": "q"}]}, ["a.jsonl:3", "no 'reasoning' and no 'content'"]),
    ('{"id": "x", "messages": [', ["a.jsonl:3", "malformed JSON line"]),
    ({"id": "x", "prompt": "q", "content": "c", "token_ids": [1], "prompt_token_ids": [2]}, ["a.jsonl:3", "01c"]),
    ({"id": "a", "prompt": "q", "content": "c"}, ["a.jsonl:3", "'a' appears twice"]),
    ({"id": "x", "content": "c"}, ["a.jsonl:3", "no 'messages'"]),
    ({"id": "x", "prompt": "q", "content": "c", "finish_reason": "tool_calls"}, ["a.jsonl:3", "finish_reason"]),
])
def test_bad_input_is_one_error_line_and_keeps_the_previous_import(tmp_path, k25_tokenizer_dir, bad, needles):
    out = tmp_path / "gen"
    answers = write_answers(tmp_path / "a.jsonl", ANSWERS)
    assert run(IMPORT, "--input", answers, "--output-dir", out, "--tokenizer", k25_tokenizer_dir).returncode == 0
    before = {n: (out / n).read_bytes() for n in ("raw_responses.jsonl", "manifest.json")}
    # The same input file, edited: the same run (by its settings), so it is rebuilt, and fails.
    write_answers(answers, ANSWERS[:2] + [bad] + ANSWERS[3:])
    res = run(IMPORT, "--input", answers, "--output-dir", out, "--tokenizer", k25_tokenizer_dir)
    assert_one_error_line(res, *needles)
    # The failed import stopped after writing two records to its temp file; the complete output
    # before it is untouched and still complete, and no temp file is left behind.
    assert {n: (out / n).read_bytes() for n in before} == before
    assert not any(p.name.startswith(TMP_PREFIX) for p in out.iterdir())


def test_an_import_of_other_settings_is_refused_unless_overwrite(tmp_path, k25_tokenizer_dir):
    out, answers = tmp_path / "gen", write_answers(tmp_path / "a.jsonl", ANSWERS)
    assert run(IMPORT, "--input", answers, "--output-dir", out, "--tokenizer", k25_tokenizer_dir).returncode == 0
    before = (out / "raw_responses.jsonl").read_bytes()
    # The ids' source field decides the ids, so another one is another data set (run.json, rerun.py).
    assert_one_error_line(run(IMPORT, "--input", answers, "--output-dir", out, "--tokenizer", k25_tokenizer_dir,
                              "--id-field", "id"), "id_field=None", "id_field='id'", "--overwrite")
    assert (out / "raw_responses.jsonl").read_bytes() == before


def test_a_failed_first_import_leaves_nothing_that_counts(tmp_path, k25_tokenizer_dir):
    out = tmp_path / "gen"
    res = run(IMPORT, "--input", write_answers(tmp_path / "a.jsonl", ANSWERS[:2] + ["{oops"]), "--output-dir", out,
              "--tokenizer", k25_tokenizer_dir)
    assert_one_error_line(res, "malformed JSON line")
    assert not (out / "manifest.json").exists() and not (out / "raw_responses.jsonl").exists()
    assert_one_error_line(run(TOKENIZE, "--raw-dir", out, "--tokenizer", k25_tokenizer_dir))


def test_a_01b_directory_is_not_overwritten_by_an_import(tmp_path, k25_tokenizer_dir):
    prompts = write_prompts(tmp_path / "p.jsonl", ["q1", "q2"])
    out = tmp_path / "gen"
    with FaultServer(tmp_path, "--tokenizer", str(k25_tokenizer_dir)) as fs:
        assert run_gen(prompts, out, fs.url).returncode == 0
    before = (out / "raw_responses.jsonl").read_bytes()
    answers = write_answers(tmp_path / "a.jsonl", ANSWERS)
    assert_one_error_line(run(IMPORT, "--input", answers, "--output-dir", out, "--tokenizer", k25_tokenizer_dir),
                          "holds a 01b_generate_synthetic run", "--overwrite")
    assert (out / "raw_responses.jsonl").read_bytes() == before
    res = run(IMPORT, "--input", answers, "--output-dir", out, "--tokenizer", k25_tokenizer_dir, "--overwrite")
    assert res.returncode == 0 and "moved the previous output" in res.stdout
    assert len(read_records(out / "raw_responses.jsonl")) == 4


# ----------------------------------------------------------------------------- 01b's fallback

def test_01b_falls_back_to_text_only_when_asked(tmp_path, k25_tokenizer_dir, k25_tokenizer):
    prompts = write_prompts(tmp_path / "p.jsonl", [f"question {i}" for i in range(6)])
    # Every other answer comes without token ids (a server ignoring return_token_ids).
    with FaultServer(tmp_path, "--schedule", "ok,notokens", "--cycle", "--tokenizer", str(k25_tokenizer_dir)) as fs:
        refused = run_gen(prompts, tmp_path / "refused", fs.url, "--concurrency", "1")
        res = run_gen(prompts, tmp_path / "gen", fs.url, "--concurrency", "1", "--allow-text-fallback",
                      "--tokenizer", str(k25_tokenizer_dir), "--tokenize")
    # Without the flag, today's refusal: those ids fail (no_token_ids) and nothing is re-wrapped.
    assert refused.returncode == 1
    assert {e["error_type"] for e in read_records(tmp_path / "refused" / "errors.jsonl")} == {"no_token_ids"}
    assert all(r.get("source") != "text" for r in read_records(tmp_path / "refused" / "raw_responses.jsonl"))

    assert res.returncode == 0, res.stderr
    out = tmp_path / "gen"
    recs = read_records(out / "raw_responses.jsonl")
    text = [r for r in recs if r.get("source") == "text"]
    assert len(recs) == 6 and len(text) == 3
    for r in text:
        assert (r["prompt_token_ids"], r["token_ids"]) == by_hand(k25_tokenizer, r["messages"], r["reasoning"],
                                                                  r["content"])
    m = json.loads((out / "manifest.json").read_text())
    assert m["counts"]["text_derived"] == 3 and m["text_derived"] is True and m["counts"]["failed"] == 0
    assert "text cannot restore" in m["text_warning"]
    assert "warning: 3 of 6 answers have text-derived ids" in res.stderr
    ts = TrainingSet(out / "tokenized")
    assert ts.manifest["text_derived"] is True and ts.manifest["counts"]["sources"] == {"text": 3, "token_ids": 3}
