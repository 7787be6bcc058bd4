"""01b's client: response parsing, error classes, backoff, endpoint spreading (fault server)."""

from __future__ import annotations

import asyncio
import json
import random

import pytest
from eagle3_train.common.client import ChatClient, ResponseError, backoff_delay, is_retryable_status, parse_completion
from eagle3_train.common.errors import PipelineError
from helpers_generate import FaultServer

MSG = [{"role": "user", "content": "hi"}]


def completion(**over):
    d = {"model": "m", "prompt_token_ids": [1, 2], "usage": {"completion_tokens": 3},
         "choices": [{"message": {"content": "c", "reasoning": "r"}, "token_ids": [5, 6, 7],
                      "finish_reason": "stop"}]}
    d.update(over)
    return json.dumps(d).encode()


def test_parse_completion_reads_vllm_fields():
    a = parse_completion(completion())
    assert (a["reasoning"], a["content"], a["prompt_token_ids"], a["token_ids"], a["finish_reason"]) == \
        ("r", "c", [1, 2], [5, 6, 7], "stop")
    old = json.loads(completion())
    old["choices"][0]["message"] = {"content": "c", "reasoning_content": "old name"}
    assert parse_completion(json.dumps(old).encode())["reasoning"] == "old name"


@pytest.mark.parametrize("body, kind, retryable", [
    (b'{"choices": [', "bad_json", True),
    (b'{"result": 1}', "bad_schema", False),
    (completion(prompt_token_ids=None), "no_token_ids", False),
    (completion(prompt_token_ids=["a"]), "bad_schema", False),
    (json.dumps({"prompt_token_ids": [1], "choices": [{"message": {}, "token_ids": [1],
                                                         "finish_reason": "abort"}]}).encode(),
     "finish_abort", True),
])
def test_parse_completion_rejects_unusable_answers(body, kind, retryable):
    with pytest.raises(ResponseError) as e:
        parse_completion(body)
    assert (e.value.kind, e.value.retryable) == (kind, retryable)


def test_retryable_statuses():
    assert all(is_retryable_status(s) for s in (408, 409, 429, 500, 502, 503, 504))
    assert not any(is_retryable_status(s) for s in (400, 401, 403, 404, 413, 422))


def test_backoff_grows_is_jittered_and_capped():
    rng = random.Random(0)
    for attempt in range(1, 12):
        step = min(30.0, 0.5 * 2 ** (attempt - 1))
        ds = [backoff_delay(attempt, 0.5, 30.0, rng) for _ in range(200)]
        assert all(step / 2 <= d <= step for d in ds)
        assert max(ds) - min(ds) > step / 4  # jitter: not one value
    assert backoff_delay(1, 0.5, 30.0, rng, retry_after=10) == 10  # Retry-After wins when longer
    assert backoff_delay(1, 0.5, 30.0, rng, retry_after=1000) == 30  # but is capped


def test_request_body_always_asks_for_token_ids():
    c = ChatClient(["http://x/v1"], "m")
    b = json.loads(c.body(MSG, {"max_tokens": 5, "temperature": None}, chat_template_kwargs={"thinking": False},
                          extra_body={"top_k": 3, "return_token_ids": False}))
    assert b == {"model": "m", "messages": MSG, "spaces_between_special_tokens": False, "max_tokens": 5,
                 "chat_template_kwargs": {"thinking": False}, "top_k": 3, "return_token_ids": True}
    over = json.loads(c.body(MSG, {}, extra_body={"spaces_between_special_tokens": True}))
    assert over["spaces_between_special_tokens"] is True


def run(coro):
    return asyncio.run(coro)


async def complete_many(urls, texts, **kw):
    async with ChatClient(urls, "fake", **kw) as c:
        outs = await asyncio.gather(*(c.complete(c.body([{"role": "user", "content": t}], {})) for t in texts))
        return outs, c


def test_fault_classes_end_to_end(tmp_path):
    cases = {  # directive -> (ok, error_type, attempts) with max_retries=2
        "[[fault:500,ok]]": (True, None, 2),
        "[[fault:429,503,ok]]": (True, None, 3),
        "[[fault:reset,ok]]": (True, None, 2),
        "[[fault:malformed,ok]]": (True, None, 2),
        "[[fault:delay=8,ok]]": (True, None, 2),
        "[[fault:500]]": (False, "http_500", 3),
        "[[fault:reset]]": (False, "connection", 3),
        "[[fault:404]]": (False, "http_404", 1),
        "[[fault:schema]]": (False, "bad_schema", 1),
        "[[fault:notokens]]": (False, "no_token_ids", 1),
        "[[fault:length]]": (True, None, 1),
    }
    with FaultServer(tmp_path) as fs:
        outs, client = run(complete_many([fs.url], list(cases), timeout=3.0, max_retries=2, backoff_base=0.05,
                                         backoff_max=0.2))
    for (text, (ok, etype, attempts)), out in zip(cases.items(), outs):
        assert out.ok == ok, (text, out.error)
        assert out.attempts == attempts, (text, out)
        if not ok:
            assert out.error["error_type"] == etype and out.error["attempts"] == attempts
            assert out.error["retryable"] == (etype in ("http_500", "connection"))
            assert out.error["message"] and "\n" not in out.error["message"]
    # every attempt that went again is counted by its cause, with the first message of each
    causes = client.retry_causes
    assert client.retries == sum(o.attempts - 1 for o in outs) == sum(c["count"] for c in causes.values())
    assert {k: c["count"] for k, c in causes.items()} == {
        "http_500": 3, "http_429": 1, "http_503": 1, "connection": 3, "bad_json": 1, "timeout": 1}
    assert causes["timeout"]["first"] == "no complete answer within 3 s (--timeout)"
    length = outs[list(cases).index("[[fault:length]]")]
    assert length.answer["finish_reason"] == "length" and length.answer["content"] is None


def test_timeout_is_a_whole_attempt_deadline(tmp_path):
    with FaultServer(tmp_path) as fs:
        (out,), _ = run(complete_many([fs.url], ["[[fault:delay=30]]"], timeout=1.0, max_retries=1,
                                      backoff_base=0.01))
    assert not out.ok and out.error["error_type"] == "timeout" and out.attempts == 2
    assert out.latency_s < 25  # two 1 s attempts, not the server's 30 s


def test_requests_spread_over_endpoints_and_retries_move(tmp_path):
    with FaultServer(tmp_path) as a, FaultServer(tmp_path) as b:
        outs, c = run(complete_many([a.url, b.url], [f"q{i}" for i in range(40)], concurrency=8))
        assert all(o.ok for o in outs)
        na, nb = len(a.requests()), len(b.requests())
        assert na + nb == 40 and min(na, nb) >= 10, (na, nb)
        # A retry goes to the other endpoint: each server sees the prompt once, so each answers
        # its first (failing) step, and the sample fails after 2 attempts on 2 servers.
        outs, _ = run(complete_many([a.url, b.url], ["[[fault:500,ok]]"], max_retries=1, backoff_base=0.01))
        assert not outs[0].ok and outs[0].attempts == 2
        seen = [[r for r in s.requests() if r["text"] == "[[fault:500,ok]]"] for s in (a, b)]
        assert [len(x) for x in seen] == [1, 1]


def test_one_dead_endpoint_does_not_lose_samples(tmp_path):
    from eagle3_train.common.vllm_server import free_port

    dead = f"http://127.0.0.1:{free_port()}/v1"
    with FaultServer(tmp_path) as a:
        outs, c = run(complete_many([dead, a.url], [f"q{i}" for i in range(12)], max_retries=3,
                                    backoff_base=0.01))
    assert all(o.ok for o in outs) and all(o.endpoint == a.url for o in outs)


def test_preflight_names_the_models_served(tmp_path):
    async def pre(urls, model):
        async with ChatClient(urls, model) as c:
            return await c.preflight()

    from eagle3_train.common.vllm_server import free_port

    with FaultServer(tmp_path) as fs:
        with pytest.raises(PipelineError, match="does not serve model 'other'.*fake"):
            run(pre([fs.url], "other"))
        dead = f"http://127.0.0.1:{free_port()}/v1"
        warnings = run(pre([fs.url, dead], "fake"))
        assert len(warnings) == 1 and dead in warnings[0]
    with pytest.raises(PipelineError, match="no endpoint is reachable"):
        run(pre([dead], "fake"))


def test_metrics_of_a_server_that_is_not_vllm_is_a_reason_not_an_error(tmp_path):
    """The fault server is no vLLM: its /metrics is a 404, a dead endpoint is unreachable; both are
    reasons (01b then notes them), not failures. A real vLLM's text: test_generate_vllm.py."""
    async def metrics(urls):
        async with ChatClient(urls, "fake", timeout=10) as c:
            await c.preflight()
            return [(ep.url, ep.max_model_len, text, why) for ep, text, why in await c.metrics()]

    from eagle3_train.common.vllm_server import free_port

    dead = f"http://127.0.0.1:{free_port()}/v1"
    with FaultServer(tmp_path) as fs:
        (a, b) = run(metrics([fs.url, dead]))
    assert a == (fs.url, None, None, "HTTP 404")  # and its /models card carries no max_model_len
    assert b[:3] == (dead, None, None) and b[3] and "404" not in b[3]


def test_01b_notes_a_server_without_cache_figures_and_still_runs(tmp_path):
    from helpers_generate import run_gen, write_prompts

    prompts = write_prompts(tmp_path / "p.jsonl", ["q0", "q1"])
    with FaultServer(tmp_path) as fs:
        # a pinned --concurrency is checked against the cache (auto says its own line: test_concurrency.py)
        r = run_gen(prompts, tmp_path / "out", fs.url, "--max-tokens", "100", "--timeout", "30", "--concurrency", "64")
    assert r.returncode == 0, r.stderr
    note = f"note: {fs.url}: no KV cache figures at {fs.url[:-3]}/metrics (HTTP 404)"
    assert note in r.stdout and "warning:" not in r.stdout, r.stdout
    assert note in (tmp_path / "out" / "progress.log").read_text()
    m = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert m["this_run"]["server_cache"]["endpoints"] == {fs.url: {"note": "HTTP 404"}}
