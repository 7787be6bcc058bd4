"""01b end to end against the fault-injecting server: nothing lost, nothing doubled, resumable."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections import Counter

import pytest
from eagle3_train.generate.stage import plan_work
from helpers_generate import FaultServer, env, gen_cmd, read_records, run_gen, write_prompts
from hypothesis import given
from hypothesis import strategies as st

pytestmark = pytest.mark.e2e  # stage processes, kill -9, real files: the slow part of the suite

FAST = ["--backoff-base", "0.05", "--backoff-max", "0.3", "--timeout", "2", "--max-retries", "2"]


# ----------------------------------------------------------------------------- pure planning

def test_plan_work_examples():
    p = plan_work(["a", "b", "c", "d", "b"], committed=["b", "x"], failed=["c"])
    assert p.pending == ["a", "c", "d"] and p.done == 1 and p.retrying == 1
    assert plan_work(["a"], ["a"], []).pending == []
    assert plan_work([], ["a"], ["b"]).pending == []


@given(st.lists(st.sampled_from("abcdefgh"), max_size=20), st.sets(st.sampled_from("abcdefghij")),
       st.sets(st.sampled_from("abcdefghij")))
def test_plan_work_is_requested_minus_committed(requested, committed, failed):
    p = plan_work(requested, committed, failed)
    assert len(p.pending) == len(set(p.pending))
    assert set(p.pending) == set(requested) - committed
    assert p.pending == sorted(p.pending, key=requested.index)  # input order kept
    assert p.done == len(set(requested) & committed)
    assert p.retrying == len(set(p.pending) & failed)


# ----------------------------------------------------------------------------- faults

CASES = {  # prompt -> expected (error_type or None, attempts) with --max-retries 2 --timeout 2
    "ok plain": (None, 1),
    "[[fault:500,ok]]": (None, 2),
    "[[fault:429,429,ok]]": (None, 3),
    "[[fault:reset,ok]]": (None, 2),
    "[[fault:malformed,ok]]": (None, 2),
    "[[fault:delay=6,ok]]": (None, 2),
    "[[fault:length]]": (None, 1),
    "[[fault:503]]": ("http_503", 3),
    "[[fault:reset]]": ("connection", 3),
    "[[fault:delay=30]]": ("timeout", 3),
    "[[fault:400]]": ("http_400", 1),
    "[[fault:schema]]": ("bad_schema", 1),
    "[[fault:notokens]]": ("no_token_ids", 1),
    "[[fault:malformed]]": ("bad_json", 3),
}


def test_every_id_ends_once_with_its_reason_and_a_rerun_completes(tmp_path):
    texts = list(CASES) + [f"filler {i}" for i in range(10)]
    prompts = write_prompts(tmp_path / "p.jsonl", texts)
    out = tmp_path / "gen"
    with FaultServer(tmp_path) as fs:
        r = run_gen(prompts, out, fs.url, "--concurrency", "6", *FAST)
    assert r.returncode == 1, r.stderr  # some ids failed: said, and the exit code says so
    assert "failed after retries" in r.stderr
    raw, errs = read_records(out / "raw_responses.jsonl"), read_records(out / "errors.jsonl")
    ids = [x["id"] for x in raw] + [x["id"] for x in errs]
    assert Counter(ids) == Counter(f"q{i:03d}" for i in range(len(texts)))  # each id exactly once
    by_text = {x["messages"][-1]["content"]: x for x in raw}
    err_by_id = {x["id"]: x for x in errs}
    for i, (text, (etype, attempts)) in enumerate(CASES.items()):
        if etype is None:
            rec = by_text[text]
            assert rec["attempts"] == attempts, text
            assert rec["token_ids"] and rec["prompt_token_ids"] and rec["reasoning"]
            assert rec["messages"] == [{"role": "user", "content": text}]  # old answer not sent
        else:
            e = err_by_id[f"q{i:03d}"]
            assert (e["error_type"], e["attempts"]) == (etype, attempts), (text, e)
            assert e["message"] and "retryable" in e
    assert by_text["[[fault:length]]"]["finish_reason"] == "length"
    manifest = json.loads((out / "manifest.json").read_text())
    n_err = sum(1 for e, _ in CASES.values() if e)
    assert manifest["counts"]["failed"] == n_err and manifest["counts"]["answered"] == len(texts) - n_err
    log = (out / "progress.log").read_text().splitlines()
    assert f"done {len(texts)}/{len(texts)}" in log[-1] and f"errors {n_err}" in log[-1]
    # every attempt that went again, counted by its cause: in the manifest and on one line of the log
    retried = sum(x["attempts"] - 1 for x in raw + errs)
    causes = manifest["counts"]["this_run"]["retry_causes"]
    assert retried == manifest["counts"]["this_run"]["retries"] == sum(c["count"] for c in causes.values()) > 0
    assert causes["bad_json"]["count"] >= 2 and "not valid JSON" in causes["bad_json"]["first"]
    (line,) = [x for x in log if "attempts were retried this run" in x]
    assert f"01b: {retried} attempts were retried this run: " in line and "bad_json x" in line

    # The server is fixed; the same command retries only the failed ids and completes the set.
    before = {x["id"]: x for x in raw}
    with FaultServer(tmp_path, "--heal") as fs:
        r = run_gen(prompts, out, fs.url, "--concurrency", "6", *FAST)
        asked = Counter(x["text"] for x in fs.requests())
    assert r.returncode == 0, r.stderr
    assert sum(asked.values()) == n_err  # nothing answered before was asked again
    raw2 = read_records(out / "raw_responses.jsonl")
    assert Counter(x["id"] for x in raw2) == Counter(f"q{i:03d}" for i in range(len(texts)))
    assert all(before[x["id"]] == x for x in raw2 if x["id"] in before)  # untouched
    assert read_records(out / "errors.jsonl") == []  # nothing left failed
    assert json.loads((out / "manifest.json").read_text())["counts"]["failed"] == 0


def test_server_restart_mid_run_loses_nothing(tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", [f"question {i}" for i in range(60)])
    out = tmp_path / "gen"
    fs = FaultServer(tmp_path, "--delay", "0.05").start()
    proc = subprocess.Popen(gen_cmd(prompts, out, fs.url, "--concurrency", "4", "--max-retries", "8",
                                    "--backoff-base", "0.2", "--backoff-max", "2"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env())
    try:
        wait_for_lines(out / "raw_responses.jsonl", 10, proc)
        fs.kill()  # a crash: connections in flight are reset, new ones refused
        time.sleep(1.5)
        fs.start()
        stdout, stderr = proc.communicate(timeout=180)
    finally:
        fs.stop()
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr
    raw = read_records(out / "raw_responses.jsonl")
    assert sorted(x["id"] for x in raw) == [f"q{i:03d}" for i in range(60)]
    assert any(x["attempts"] > 1 for x in raw)  # the restart was felt, and retried through


def wait_for_lines(path, n, proc, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_bytes().count(b"\n") >= n:
            return
        if proc.poll() is not None:
            raise AssertionError(f"01b exited early ({proc.returncode}): {proc.stderr.read()}")
        time.sleep(0.05)
    raise AssertionError(f"{path} never reached {n} lines")


def answers(path):
    keep = ("id", "messages", "reasoning", "content", "prompt_token_ids", "token_ids", "finish_reason")
    return sorted(tuple(json.dumps(x[k], sort_keys=True) for k in keep) for x in read_records(path))


def kill_trial(tmp_path, prompts, reference, kill_after: int, torn: bool):
    out = tmp_path / f"killed-{kill_after}"
    with FaultServer(tmp_path, "--delay", "0.05") as fs:
        proc = subprocess.Popen(gen_cmd(prompts, out, fs.url, "--concurrency", "4"),
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env())
        wait_for_lines(out / "raw_responses.jsonl", kill_after, proc)
        assert proc.poll() is None, "01b finished before the kill: the trial would prove nothing"
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        assert not (out / "manifest.json").exists()  # an interrupted output is not complete
        if torn:  # what a kill in the middle of a write leaves behind
            with open(out / "raw_responses.jsonl", "ab") as f:
                f.write(b'{"id": "q000", "messages": [{"role": "us')
        r = run_gen(prompts, out, fs.url, "--concurrency", "4")
    assert r.returncode == 0, r.stderr
    assert answers(out / "raw_responses.jsonl") == reference  # same ids, same answers, no doubles
    assert json.loads((out / "manifest.json").read_text())["counts"]["answered"] == N_KILL


N_KILL = 60


def kill_setup(tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", [f"question {i}" for i in range(N_KILL)])
    with FaultServer(tmp_path) as fs:
        r = run_gen(prompts, tmp_path / "reference", fs.url, "--concurrency", "4")
    assert r.returncode == 0, r.stderr
    return prompts, answers(tmp_path / "reference" / "raw_responses.jsonl")


def test_kill9_then_rerun_equals_an_uninterrupted_run(tmp_path):
    prompts, reference = kill_setup(tmp_path)
    assert len(reference) == N_KILL
    kill_trial(tmp_path, prompts, reference, kill_after=5, torn=False)
    kill_trial(tmp_path, prompts, reference, kill_after=30, torn=True)


@pytest.mark.slow
def test_kill9_sweep(tmp_path):
    prompts, reference = kill_setup(tmp_path)
    for k in range(1, 46, 2):  # 23 trials
        kill_trial(tmp_path, prompts, reference, kill_after=k, torn=k % 4 == 1)


def test_sigterm_stops_between_records_and_resumes(tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", [f"question {i}" for i in range(40)])
    out = tmp_path / "gen"
    with FaultServer(tmp_path, "--delay", "0.1") as fs:
        proc = subprocess.Popen(gen_cmd(prompts, out, fs.url, "--concurrency", "4"),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env())
        wait_for_lines(out / "raw_responses.jsonl", 8, proc)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 143, stderr
        assert "SIGTERM" in stderr and "rerun" in stderr
        data = (out / "raw_responses.jsonl").read_bytes()
        assert data.endswith(b"\n") and len(read_records(out / "raw_responses.jsonl")) < 40
        assert not (out / "manifest.json").exists()
        assert "stopped by SIGTERM" in (out / "progress.log").read_text()
        r = run_gen(prompts, out, fs.url, "--concurrency", "4")
    assert r.returncode == 0, r.stderr
    assert sorted(x["id"] for x in read_records(out / "raw_responses.jsonl")) == [f"q{i:03d}" for i in range(40)]


def test_a_second_process_on_the_same_directory_is_refused(tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", [f"question {i}" for i in range(30)])
    out = tmp_path / "gen"
    with FaultServer(tmp_path, "--delay", "0.3") as fs:
        first = subprocess.Popen(gen_cmd(prompts, out, fs.url, "--concurrency", "1"),
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env())
        try:
            wait_for_lines(out / "raw_responses.jsonl", 1, first)
            r = run_gen(prompts, out, fs.url)
        finally:
            first.kill()
            first.wait()
    assert r.returncode == 2 and "in use by another process" in r.stderr


def test_a_rerun_with_other_sampling_is_refused_unless_overwrite(tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", ["a", "b"])
    out = tmp_path / "gen"
    with FaultServer(tmp_path) as fs:
        assert run_gen(prompts, out, fs.url, "--temperature", "0.6").returncode == 0
        r = run_gen(prompts, out, fs.url, "--temperature", "1.0")
        assert r.returncode == 2
        assert r.stderr.strip().count("\n") == 0 and "temperature=0.6" in r.stderr and "temperature=1.0" in r.stderr
        # operational settings may change between runs
        assert run_gen(prompts, out, fs.url, "--temperature", "0.6", "--concurrency", "3",
                       "--timeout", "99").returncode == 0
        r = run_gen(prompts, out, fs.url, "--temperature", "1.0", "--overwrite")
        assert r.returncode == 0, r.stderr
    moved = list(out.glob("replaced-*/raw_responses.jsonl"))
    assert len(moved) == 1 and len(read_records(moved[0])) == 2


def test_a_larger_limit_extends_the_run(tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", [f"q {i}" for i in range(10)])
    out = tmp_path / "gen"
    with FaultServer(tmp_path) as fs:
        assert run_gen(prompts, out, fs.url, "--limit", "4").returncode == 0
        first = read_records(out / "raw_responses.jsonl")
        r = run_gen(prompts, out, fs.url)
        asked = len(fs.requests())
    assert r.returncode == 0 and "4 already answered, 6 to do" in r.stdout
    assert asked == 10 and read_records(out / "raw_responses.jsonl")[:4] == first


@pytest.mark.parametrize("content, needle", [
    ('{"id": "a", "messages": [{"role": "user", "content": "ok"}]}\n{"id": "b", "mess', "p.jsonl:2: malformed JSON"),
    ('{"id": "a", "text": "x"}\n', "p.jsonl:1: no 'messages'"),
    ('{"id": "a", "messages": [{"role": "user", "content": ""}]}\n', "p.jsonl:1: empty prompt"),
])
def test_bad_input_is_one_error_line_and_exit_2(tmp_path, content, needle):
    (tmp_path / "p.jsonl").write_text(content)
    r = run_gen(tmp_path / "p.jsonl", tmp_path / "gen", "http://127.0.0.1:9/v1")
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], r.stderr
    assert not (tmp_path / "gen" / "raw_responses.jsonl").exists()


def test_wrong_model_and_dead_server_are_one_line_errors(tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", ["a"])
    with FaultServer(tmp_path) as fs:
        r = run_gen(prompts, tmp_path / "gen", fs.url, model="nope")
    assert r.returncode == 2 and "does not serve model 'nope'" in r.stderr
    r = run_gen(prompts, tmp_path / "gen2", "http://127.0.0.1:9/v1", "--wait-for-server", "0")
    assert r.returncode == 2 and "no endpoint is reachable" in r.stderr


# ----------------------------------------------------------------------------- a server still loading

def test_01b_waits_for_a_server_that_is_still_loading(tmp_path):
    """`vllm serve ... &` then 01b: the stand-in refuses or 503s (/health 503) for 2 s after 01b's
    first probe, then serves; 01b says it waits (progress.log) and then answers every prompt."""
    prompts = write_prompts(tmp_path / "p.jsonl", ["a", "b", "c"])
    out = tmp_path / "gen"
    fs = FaultServer(tmp_path, "--loading", "2").start(ready=False)
    try:
        r = run_gen(prompts, out, fs.url, "--wait-for-server", "600")
    finally:
        fs.stop()
    assert r.returncode == 0, r.stderr
    assert len(read_records(out / "raw_responses.jsonl")) == 3
    log = (out / "progress.log").read_text()
    assert f"01b_generate_synthetic waiting for {fs.url} (loading: " in log and " of 10m" in log, log
    assert any(g["loading"] for g in fs.gets("/health"))  # it asked vLLM's /health while /v1/models failed


def test_01b_is_refused_at_once_by_a_server_that_is_not_vllm(tmp_path):
    """An HTML page at /v1/models: today's one line, with the default wait of an hour not taken
    (no waiting line, /health never asked)."""
    prompts = write_prompts(tmp_path / "p.jsonl", ["a"])
    with FaultServer(tmp_path, "--models-html") as fs:
        r = run_gen(prompts, tmp_path / "gen", fs.url)
    assert r.returncode == 2 and "did not answer in the OpenAI schema" in r.stderr, r.stderr
    assert fs.gets("/health") == [] and "waiting for" not in r.stdout + r.stderr


def test_ctrl_c_while_01b_waits_is_exit_130(tmp_path):
    from eagle3_train.common.vllm_server import free_port

    prompts = write_prompts(tmp_path / "p.jsonl", ["a"])
    out = tmp_path / "gen"
    proc = subprocess.Popen(gen_cmd(prompts, out, f"http://127.0.0.1:{free_port()}/v1"), env=env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log = out / "progress.log"
    deadline = time.monotonic() + 120
    while "waiting for" not in (log.read_text() if log.exists() else ""):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "interrupted" in err and "Traceback" not in err, err
    assert "stopped by SIGINT" in log.read_text().splitlines()[-1]


def test_a_dead_server_mid_run_aborts_after_a_streak_of_failures(tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", [f"q {i}" for i in range(30)])
    out = tmp_path / "gen"
    with FaultServer(tmp_path, "--schedule", ",".join(["ok"] * 3 + ["500"] * 500)) as fs:
        r = run_gen(prompts, out, fs.url, "--concurrency", "1", "--max-retries", "0", "--abort-after", "5")
    assert r.returncode == 2 and "5 requests in a row failed" in r.stderr
    assert len(read_records(out / "raw_responses.jsonl")) == 3
    assert len(read_records(out / "errors.jsonl")) == 5
    assert not (out / "manifest.json").exists()
