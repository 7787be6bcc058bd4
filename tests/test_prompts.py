"""01b's prompt loading: formats, stable ids, dedup, shards, and one clear line for bad rows."""

from __future__ import annotations

import json

import pytest
from eagle3_train.common.errors import PipelineError
from eagle3_train.common.prompts import content_id, load_prompts, parse_shard, row_to_prompt, select


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_openai_rows_drop_the_final_answer_and_keep_earlier_turns():
    row = {"id": 7, "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello", "reasoning_content": "greet back"},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"}]}
    p = row_to_prompt(row)
    assert p.id == "7"
    assert [m["role"] for m in p.messages] == ["system", "user", "assistant", "user"]
    assert p.messages[2] == {"role": "assistant", "content": "hello", "reasoning_content": "greet back"}
    assert p.messages[-1]["content"] == "2+2?"


def test_sharegpt_and_perfectblend_rows():
    sharegpt = {"conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "q"},
                                  {"from": "gpt", "value": "a"}], "source": "x"}
    p = row_to_prompt(sharegpt)
    assert p.messages == [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]
    assert p.id == content_id(p.messages)  # no id in the row: a hash of what is sent


def test_ultrachat_prompt_id_and_content_parts():
    row = {"prompt_id": "abc", "prompt": "ignored when messages exist", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "part one "}, {"type": "text", "text": "two"}]},
        {"role": "assistant", "content": "x"}]}
    p = row_to_prompt(row)
    assert p.id == "abc" and p.messages == [{"role": "user", "content": "part one two"}]


def test_a_bare_prompt_field_is_one_user_turn():
    assert row_to_prompt({"prompt": "hello"}).messages == [{"role": "user", "content": "hello"}]


def test_content_hash_is_stable_and_depends_on_the_conversation_only():
    a = row_to_prompt({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a1"}]})
    b = row_to_prompt({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a2"}]})
    c = row_to_prompt({"messages": [{"role": "user", "content": "q2"}]})
    assert a.id == b.id != c.id  # the dropped answer does not change what is sent


def test_dedup_limit_and_counts(tmp_path):
    rows = [{"id": "a", "prompt": "1"}, {"id": "b", "prompt": "2"}, {"id": "a", "prompt": "1"},
            {"id": "c", "prompt": "3"}, {"id": "d", "prompt": "4"}]
    ps = load_prompts(str(write_jsonl(tmp_path / "p.jsonl", rows)))
    assert ps.ids == ["a", "b", "c", "d"]  # the same row again is asked once
    assert ps.counts["duplicates"] == 1 and ps.counts["duplicates_differing"] == 0
    assert load_prompts(str(tmp_path / "p.jsonl"), limit=2).ids == ["a", "b"]
    assert ps.source["kind"] == "file" and len(ps.source["sha256"]) == 64


def test_one_id_with_two_conversations_is_refused_naming_both_rows(tmp_path):
    rows = [{"id": "a", "prompt": "1"}, {"id": "b", "prompt": "2"}, {"id": "a", "prompt": "other"}]
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    with pytest.raises(PipelineError, match=rf"{path}:3: id 'a' appears twice with different conversations "
                                            rf"\(first at {path}:1\)"):
        load_prompts(str(path))
    ps = load_prompts(str(path), skip_invalid=True)  # asked to skip bad rows: the first wins, counted
    assert ps.ids == ["a", "b"] and ps.prompts[0].messages[0]["content"] == "1"
    assert ps.counts["duplicates"] == 1 and ps.counts["duplicates_differing"] == 1


def test_shards_partition_the_ids(tmp_path):
    rows = [{"id": f"x{i}", "prompt": f"q{i}"} for i in range(200)]
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    shards = [load_prompts(str(path), shard=(i, 3)).ids for i in range(3)]
    assert sorted(sum(shards, [])) == sorted(r["id"] for r in rows)
    assert all(len(set(a) & set(b)) == 0 for a in shards for b in shards if a is not b)
    assert all(40 < len(s) < 95 for s in shards)  # a hash split, roughly even
    # stable: the same id lands in the same shard whatever else is in the file
    assert load_prompts(str(write_jsonl(tmp_path / "q.jsonl", rows[::-1])), shard=(1, 3)).ids == shards[1][::-1]


def test_json_array_file_and_wrapped_list(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps([{"id": 1, "prompt": "p"}]))
    (tmp_path / "b.json").write_text(json.dumps({"data": [{"id": 2, "prompt": "p"}]}))
    assert load_prompts(str(tmp_path / "a.json")).ids == ["1"]
    assert load_prompts(str(tmp_path / "b.json")).ids == ["2"]


def test_saved_dataset_directory(tmp_path):
    import datasets

    ds = datasets.Dataset.from_list([{"prompt_id": "u1", "messages": [{"role": "user", "content": "q"}]}])
    ds.save_to_disk(str(tmp_path / "ds"))
    ps = load_prompts(str(tmp_path / "ds"))
    assert ps.ids == ["u1"] and ps.source["kind"] == "dataset" and ps.source["fingerprint"]


@pytest.mark.parametrize("line, needle", [
    ('{"id": 1, "messages": [', "malformed JSON line"),
    ('{"id": 1, "text": "no conversation"}', "no 'messages', 'conversations'"),
    ('{"id": 1, "messages": [{"role": "user"}]}', "missing content"),
    ('{"id": 1, "messages": [{"role": "user", "content": "   "}]}', "empty prompt"),
    ('{"id": 1, "messages": [{"role": "robot", "content": "x"}]}', "unknown or missing 'role'"),
    ('{"id": 1, "messages": [{"role": "assistant", "content": "only an answer"}]}', "does not end with a user turn"),
    ('[1, 2]', "expected a JSON object"),
])
def test_bad_rows_name_file_and_line(tmp_path, line, needle):
    path = write_jsonl(tmp_path / "p.jsonl", [{"id": 0, "prompt": "fine"}, line])
    with pytest.raises(PipelineError) as e:
        load_prompts(str(path))
    msg = str(e.value)
    assert f"{path}:2" in msg and needle in msg and "\n" not in msg


def test_skip_invalid_counts_instead_of_failing(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"id": 0, "prompt": "fine"}, {"id": 1, "prompt": ""},
                                              {"id": 2, "nothing": 1}])
    ps = load_prompts(str(path), skip_invalid=True)
    assert ps.ids == ["0"] and ps.counts["invalid"] == 2


def test_missing_input_and_bad_shard(tmp_path):
    with pytest.raises(PipelineError, match="no such file"):
        load_prompts(str(tmp_path / "nope.jsonl"))
    with pytest.raises(PipelineError, match="I/N"):
        parse_shard("1-4")
    with pytest.raises(PipelineError, match="0 <= I < N"):
        parse_shard("4/4")
    with pytest.raises(PipelineError, match="no prompts selected"):
        load_prompts(str(write_jsonl(tmp_path / "e.jsonl", [])))


def test_id_field_option():
    prompts, _ = select([("x:1", {"key": "k1", "prompt": "a"})], id_key="key")
    assert prompts[0].id == "k1"
