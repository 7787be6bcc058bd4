"""05's acceptance along the answer from vLLM's per-request record (`metrics.speculative_decoding`
with `--per-request-spec-decode-metrics detailed`): the record -> counts by position, its exactness
check, the sums held against /metrics, report.md's section and plot, the pilot's table, and the
bad inputs of this surface. The real-vLLM checks are folded into tests/test_evaluate.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from eagle3_train.common import positions
from eagle3_train.common.errors import run_main
from eagle3_train.evaluate.online import (
    RECORD_ARGS,
    PositionTally,
    RecordingClient,
    arm_server,
    merge_by_position,
    record_counts,
    spec_record,
)
from helpers import stage_cli

EDGES = (0, 32, 64, 128)


def chat_body(prompt_tokens: int, accepted: list[int], k: int = 3, completion: int | None = None,
              level: str = "detailed") -> dict:
    """A vLLM 0.32 chat completion as the server sends it, with the record of its verify steps
    (vllm/v1/metrics/stats.py RequestSpecDecodeMetrics.to_dict)."""
    covered = 1 + sum(a + 1 for a in accepted)
    completion = covered if completion is None else completion
    hist = [accepted.count(j) for j in range(k + 1)]
    rec = {"mean_acceptance_length": 1 + sum(accepted) / len(accepted) if accepted else 1.0,
           "draft_acceptance_rate": sum(accepted) / (k * len(accepted)) if accepted else 0.0,
           "acceptance_histogram": hist, "num_spec_steps": len(accepted),
           "num_accepted_draft_tokens": sum(accepted), "num_draft_tokens": k * len(accepted), "num_spec_tokens": k}
    if level == "detailed" and accepted:
        rec |= {"per_step_accepted": accepted, "per_step_drafted": [k] * len(accepted)}
    body = {"id": "chatcmpl-1", "object": "chat.completion", "model": "m", "prompt_token_ids": [1] * prompt_tokens,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "x", "reasoning": None},
                         "finish_reason": "stop", "token_ids": [2] * completion}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                      "total_tokens": prompt_tokens + completion}}
    if level != "none":
        body["metrics"] = {"speculative_decoding": rec}
    return body


def parse(body: dict) -> dict:
    return RecordingClient(["http://x/v1"], "m").parse(json.dumps(body).encode())


def test_the_record_places_each_step_at_its_first_drafted_position():
    # prefill makes position 30; steps then draft from 31, 31+3+1=35, 36, 36+2+1=39
    counts, exact = record_counts(spec_record(chat_body(30, [3, 0, 2, 1])), 30, 11, 3, EDGES)
    assert exact
    assert counts["drafts"] == [1, 3, 0, 0] and counts["accepted"] == [3, 3, 0, 0]
    assert counts["hits"][0] == [1, 1, 1] and counts["hits"][1] == [2, 1, 0]
    assert counts == positions.from_vllm_steps(30, [3, 0, 2, 1], [3, 3, 3, 3], 3, EDGES)


@pytest.mark.parametrize("completion, exact", [
    (11, True),   # every step's tokens kept
    (10, True),   # the last step's bonus token came after the stop: dropped
    (12, False),  # a token no step accounts for: a step decoded without drafting
    (7, False),   # 4 tokens past the end: more than the last step can overshoot (K = 3)
])
def test_a_record_is_exact_only_when_its_steps_cover_the_answer(completion, exact):
    rec = spec_record(chat_body(30, [3, 0, 2, 1], completion=completion))
    assert record_counts(rec, 30, completion, 3, EDGES)[1] is exact


def test_only_a_detailed_record_counts():
    assert spec_record(chat_body(30, [1, 2])) is not None
    assert spec_record(chat_body(30, [1, 2], level="summary")) is None  # counts without their order
    assert spec_record(chat_body(30, [1, 2], level="none")) is None
    assert spec_record(chat_body(30, [], level="detailed")) is not None  # an answer that never drafted
    assert spec_record({"choices": []}) is None


def test_the_client_keeps_the_record_and_the_tally_holds_it_against_metrics():
    tally = PositionTally(3, EDGES)
    for body in (chat_body(30, [3, 0, 2, 1]), chat_body(60, [1, 1], completion=4), chat_body(100, [2, 3, 0])):
        answer = parse(body)
        assert answer["spec_record"]["num_spec_steps"] == body["metrics"]["speculative_decoding"]["num_spec_steps"]
        tally.add(answer)
    tally.add(parse(chat_body(30, [1], level="none")))
    same = {"drafts": 9, "draft_tokens": 27, "accepted": 13}
    res = tally.result(same)
    assert set(res) >= {"edges", "counts", "rows"} and res["edges"] == list(EDGES)
    assert res["requests"] == 3 and res["no_record"] == 1 and res["positions_inexact"] == 0
    assert res["records"] == same and res["metrics_match"] is True
    assert sum(res["counts"]["drafts"]) == 9 and sum(res["counts"]["accepted"]) == 13
    assert res["counts"]["drafts"] == [1, 5, 3, 0]  # 31 | 35 36 39 61 63 | 101 104 108
    assert [r["drafts"] for r in res["rows"]] == res["counts"]["drafts"]
    assert tally.result({**same, "accepted": 14})["metrics_match"] is False


def test_levels_merge_into_the_arm_and_no_record_gives_none():
    a, b = PositionTally(3, EDGES), PositionTally(3, EDGES)
    a.add(parse(chat_body(30, [3, 0, 2, 1])))
    b.add(parse(chat_body(100, [2, 3, 0], completion=20)))  # inexact: 20 tokens, 10 covered
    arm = merge_by_position([a.result({"drafts": 4, "draft_tokens": 12, "accepted": 6}),
                             b.result({"drafts": 3, "draft_tokens": 9, "accepted": 5})])
    assert arm["counts"]["drafts"] == [1, 3, 3, 0] and arm["requests"] == 2 and arm["positions_inexact"] == 1
    assert arm["records"] == {"drafts": 7, "draft_tokens": 21, "accepted": 11} and arm["metrics_match"] is True
    empty = PositionTally(3, EDGES)
    empty.add(parse(chat_body(30, [1], level="none")))
    assert empty.result() is None and merge_by_position([None, empty.result()]) is None


def test_servers_05_starts_send_the_record_only_when_they_speculate(tmp_path, llama_target_dir):
    kw = {"max_model_len": 512, "startup_timeout": None, "reasoning_parser": None, "extra_args": ["--seed=1"]}
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    cmd = arm_server(llama_target_dir, spec, tmp_path / "a.log", kw).cmd
    assert cmd[cmd.index(RECORD_ARGS[0]) + 1] == "detailed" and "--seed=1" in cmd
    assert RECORD_ARGS[0] not in arm_server(llama_target_dir, None, tmp_path / "b.log", kw).cmd  # vLLM refuses it


# ----------------------------------------------------------------------------- report and pilot

def _block(pos_acc: list[tuple[int, int]], k: int = 3) -> dict:
    return positions.block(positions.count([p for p, _ in pos_acc], [a for _, a in pos_acc], k, EDGES))


def _arm(by_position: dict | None, drafts: int = 10) -> dict:
    spec = {"drafts": drafts, "draft_tokens": 3 * drafts, "accepted": drafts, "per_pos": [5, 3, 2],
            "acceptance_length": 2.0, "per_position_rate": [0.5, 0.3, 0.2], "draft_token_acceptance": 0.33}
    return {"levels": [{"concurrency": 1, "output_tok_s": 10.0}], "spec": spec, "by_position": by_position}


def _run_info(k: int = 3) -> dict:
    return {"k": k, "draft": {"path": "/d"}, "target": {"name_or_path": "/t"},
            "online": {"concurrency": [1], "sampling": {}}}


def test_report_renders_a_table_per_part_and_plots_them(tmp_path):
    from eagle3_train.evaluate.report import POSITIONS_PLOT, build_report, write_report

    offline = {"acceptance_length": 2.5, "samples": 4, "drafts": 20, "cumulative": [0.8, 0.5, 0.2], "heldout": True,
               "by_position": _block([(10, 3)] * 60 + [(40, 1)] * 20)}
    online = {**_arm(_block([(10, 2), (40, 1), (70, 0)])), "by_position": {
        **_block([(10, 2), (40, 1), (70, 0)]), "requests": 2, "no_record": 1, "positions_inexact": 1,
        "records": {"drafts": 3, "draft_tokens": 9, "accepted": 3}, "metrics_match": False}}
    sweep = {3: online, 5: _arm({**_block([(10, 5), (130, 1)], k=5), "requests": 2, "no_record": 0,
                                 "positions_inexact": 0, "records": {}})}
    rep = build_report(_run_info(), offline, {"eagle3": online, "ngram": _arm(None)}, sweep, cpu=True)
    assert list(rep["by_position"]) == ["offline", "eagle3", "eagle3-k5"]
    assert rep["by_position"]["eagle3-k5"]["k"] == 5 and rep["by_position"]["offline"]["source"] == "offline"
    md = write_report(tmp_path, rep)
    section = md.split("## Acceptance along the answer", 1)[1]
    assert "### offline (simulated), K = 3" in section and "### vLLM eagle3, K = 5" in section
    assert positions.table(offline["by_position"]["rows"], 3) in section
    assert positions.table(rep["by_position"]["eagle3-k5"]["rows"], 5) in section
    assert "positions_inexact: 1 of 2 answers" in section and "1 answers came without a record" in section
    assert "other requests reached the server" in section
    assert "vLLM ngram: its server sent no per-request record (start it with " \
           "--per-request-spec-decode-metrics detailed)" in section
    assert (tmp_path / POSITIONS_PLOT).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((tmp_path / "report.json").read_text())["by_position"]["eagle3"]["rows"] == \
        online["by_position"]["rows"]
    # nothing counted by position: no section, no plot (an earlier run's is removed)
    bare = build_report(_run_info(), None, {"none": _arm(None, 0)})
    assert bare["by_position"] == {} and "Acceptance along the answer" not in write_report(tmp_path, bare)
    assert not (tmp_path / POSITIONS_PLOT).exists()


def test_the_pilot_prints_the_table_from_05s_online_part_else_offline(tmp_path):
    from eagle3_train.evaluate.report import build_report
    from eagle3_train.pilot.stage import _acceptance, position_lines

    offline = {"acceptance_length": 2.5, "by_position": _block([(10, 3)] * 3)}
    online = _arm({**_block([(10, 1), (40, 2)]), "requests": 1, "no_record": 0, "positions_inexact": 0,
                   "records": {}})
    (tmp_path / "05").mkdir()
    for arms, which in (({"eagle3": online}, "eagle3"), ({}, "offline")):
        rep = build_report(_run_info(), offline, arms)
        (tmp_path / "05" / "report.json").write_text(json.dumps(rep))
        al = _acceptance(tmp_path)
        lines = "\n".join(position_lines(al))
        assert al["by_position"]["name"] == which
        assert positions.table(rep["by_position"][which]["rows"], 3) in lines


# ----------------------------------------------------------------------------- bad inputs

BAD = [
    (["--server-arg=--per-request-spec-decode-metrics=summary"], "--server-arg --per-request-spec-decode-metrics"),
    (["--server-arg=--per-request-spec-decode-metrics", "--server-arg=none"], "drop this --server-arg"),
    (["--position-buckets", "2k,1k"], "--position-buckets"),
    (["--position-buckets", "512,,2k"], "--position-buckets"),
    (["--position-buckets", "1.5k"], "--position-buckets"),
]


@pytest.mark.parametrize("extra, says", BAD)
def test_05_online_bad_inputs_are_one_line_before_any_server(tmp_path, llama_target_dir, extra, says, capfd):
    from eagle3_testkit.tiny import write_prompt_file

    prompts = write_prompt_file(tmp_path / "heldout.jsonl", 2, seed=99)
    out = tmp_path / "eval"
    rc = run_main(stage_cli("05_evaluate").main, ["--draft", str(tmp_path / "no-draft"), "--target",
                                                  str(llama_target_dir), "--prompts", str(prompts),
                                                  "--output-dir", str(out), *extra])
    err = capfd.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: ") and says in err[0], err
    assert not out.exists()
