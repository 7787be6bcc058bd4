"""Waiting for a server given by URL that is still loading (common/server_wait.py): the decisions
of the wait loop against tests/fault_server.py's app in a thread of this process (refusing, 503 or
404 while loading, then ready; wrong path; not vLLM; HTML), counted by the requests it logged.
The stages' own waits are in test_generate_faults.py (01b), test_extract_vllm.py (02),
test_reliability_bad_inputs.py (05) and test_generate_vllm.py (01b before a real vLLM starts)."""

from __future__ import annotations

import asyncio
import json
import threading

import fault_server
import pytest
from eagle3_train.common.errors import PipelineError
from eagle3_train.common.server_wait import (ANSWERED, LOADING, READY, check_wait, health_url, judge, span,
                                             wait_for_servers)
from eagle3_train.common.vllm_server import free_port


class StandIn:
    """fault_server's app on a free port, in a thread; `listen=False`: nothing listens on the port
    until `listen()` (connections refused, as while vLLM loads)."""

    def __init__(self, tmp_path, *args: str, listen: bool = True, app=None):
        self.port = free_port()
        self.log = tmp_path / f"gets-{self.port}.jsonl"
        self.app = app or fault_server.build_app(fault_server.parse_args(["--port", str(self.port), "--log", str(self.log), *args]))
        self._listen = threading.Event()
        if listen:
            self._listen.set()
        self._up = threading.Event()

    def listen(self) -> None:
        self._listen.set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def gets(self, path: str) -> int:
        lines = self.log.read_text().splitlines() if self.log.exists() else []
        return sum(1 for line in lines if json.loads(line).get("path") == path)

    def __enter__(self):
        from aiohttp import web

        async def serve():
            await asyncio.to_thread(self._listen.wait)
            runner = web.AppRunner(self.app)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", self.port).start()
            self._up.set()
            await self._stop.wait()
            await runner.cleanup()

        def run():
            self._stop = asyncio.Event()
            self.loop.run_until_complete(serve())

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        if self._listen.is_set():
            assert self._up.wait(30)
        return self

    def __exit__(self, *exc):
        self.loop.call_soon_threadsafe(self._stop.set)
        self.thread.join(30)


def wait(urls, wait_s: float, on_line=None):
    lines: list[str] = []

    def say(line: str) -> None:
        lines.append(line)
        if on_line:
            on_line()

    states = asyncio.run(wait_for_servers(urls, wait_s, say=say, poll_s=0.1))
    return states, lines


# ----------------------------------------------------------------------------- pure parts

@pytest.mark.parametrize("models, health, schema, verdict", [
    (None, None, False, LOADING),     # refused / reset / no answer: still loading
    (503, 503, False, LOADING),       # vLLM's /health 503 while it loads
    (404, 503, False, LOADING),       # /v1/models 404 during the load, /health not ready
    (503, None, False, LOADING),      # a proxy answers, the server behind it does not yet
    (404, 200, False, ANSWERED),      # /health ready but /models 404: the wrong path, at once
    (401, 200, False, ANSWERED),      # ready, but the key is refused
    (404, 404, False, ANSWERED),      # no /health route: not vLLM
    (200, None, True, ANSWERED),      # another schema (a proxy's HTML page)
])
def test_judge(models, health, schema, verdict):
    assert judge(models, health, schema=schema) == verdict


def test_span_health_url_and_the_flag_check():
    assert [span(s) for s in (0, 45, 270, 3600, 90)] == ["0s", "45s", "4m30s", "60m", "1m30s"]
    assert health_url("http://h:8000/v1") == health_url("http://h:8000/v1/") == "http://h:8000/health"
    assert health_url("http://h:8000") == "http://h:8000/health"
    check_wait(0)
    for bad in (-1, float("nan")):
        with pytest.raises(PipelineError, match=r"--wait-for-server must not be negative \(0 = do not wait\)"):
            check_wait(bad)


# ----------------------------------------------------------------------------- the loop

@pytest.mark.parametrize("args, listen, state", [
    ((), False, "connection refused"),  # the port listens once the first line is out
    (("--loading", "1"), True, "/models 503, /health 503"),
    (("--loading", "1", "--loading-status", "404"), True, "/models 404, /health 503"),
], ids=["refused", "503", "404-while-loading"])
def test_a_loading_server_is_waited_for_until_it_is_ready(tmp_path, args, listen, state):
    with StandIn(tmp_path, *args, listen=listen) as srv:
        states, lines = wait([srv.url], 600, on_line=srv.listen)
    assert states == {srv.url: READY}, (lines, srv.log.read_text())
    assert lines and lines[0] == f"waiting for {srv.url} (loading: {state}) 0s of 10m", lines
    assert srv.gets("/v1/models") >= (2 if listen else 1)  # asked again until it answered


@pytest.mark.parametrize("args, suffix, gets", [
    ((), "", {"/models": 2, "/health": 1, "/v1/models": 0}),                  # wrong path: /health 200
    (("--no-health",), "", {"/models": 1, "/health": 1, "/v1/models": 0}),   # no /health: not vLLM
    (("--models-html",), "/v1", {"/v1/models": 1, "/health": 0}),           # another schema
], ids=["wrong-path", "not-vllm", "html"])
def test_a_server_that_answers_otherwise_is_left_to_the_stage_at_once(tmp_path, args, suffix, gets):
    """Asked once (/models twice when /health says ready: it may have just finished loading), never
    waited for: the stage's own check then says what is wrong in one line."""
    with StandIn(tmp_path, *args) as srv:
        url = srv.url.removesuffix("/v1") + suffix
        states, lines = wait([url], 600, on_line=lambda: pytest.fail("waited for a server that answered"))
        assert states == {url: ANSWERED} and lines == []
        assert {p: srv.gets(p) for p in gets} == gets


def test_a_server_that_becomes_ready_between_its_two_gets_is_ready(tmp_path):
    """/v1/models 404 (loading), then /health 200 (it just finished): asked again, not refused."""
    from aiohttp import web

    asked = []

    async def models(_request):
        asked.append("models")
        if len(asked) == 1:
            return web.json_response({"error": {"message": "loading"}}, status=404)
        return web.json_response({"object": "list", "data": [{"id": "m", "object": "model"}]})

    async def health(_request):
        return web.Response(status=200)

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    with StandIn(tmp_path, app=app) as srv:
        states, lines = wait([srv.url], 600, on_line=lambda: pytest.fail("waited for a ready server"))
    assert states == {srv.url: READY} and asked == ["models", "models"]


def test_a_server_down_past_the_wait_is_one_line_naming_the_flag():
    url = f"http://127.0.0.1:{free_port()}/v1"
    with pytest.raises(PipelineError) as e:
        wait([url], 0.5)
    assert str(e.value).startswith(f"{url} not ready after 0.5 s (--wait-for-server); last: connection refused")


def test_0_asks_nothing(tmp_path):
    with StandIn(tmp_path, "--loading", "600") as srv:
        assert wait([srv.url], 0) == ({}, [])
        assert srv.gets("/v1/models") == srv.gets("/health") == 0


def test_one_ready_server_of_several_is_enough_at_the_deadline(tmp_path):
    """The others are then the preflight's to name (01b warns and uses the ready ones)."""
    dead = f"http://127.0.0.1:{free_port()}/v1"
    with StandIn(tmp_path) as srv:
        states, lines = wait([srv.url, dead], 0.5)
    assert states == {srv.url: READY, dead: LOADING}
    assert [line.split(" (")[0] for line in lines] == [f"waiting for {dead}"]
