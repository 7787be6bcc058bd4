#!/usr/bin/env python3
"""A fake OpenAI-compatible chat server that misbehaves on purpose (tests and benchmarks only).

It answers `/v1/chat/completions` like vLLM with `return_token_ids` (top-level `prompt_token_ids`,
`choices[0].token_ids`, `message.reasoning`), except when told to fail. What request k does is
decided, in this order, by
  1. a directive in the last user message, `[[fault:500,reset,ok]]`: the n-th request carrying
     that message gets the n-th behaviour (the last one repeats) -- deterministic under any
     concurrency, because it is keyed by the prompt, not by arrival order;
  2. `--schedule "ok,500,..."`: the n-th request to arrive gets the n-th entry (`--cycle` repeats
     the list, else `ok` after it);
  3. `ok`.

Behaviours:
  ok              a normal answer (deterministic: derived from the prompt text)
  delay=S         sleep S seconds, then answer (S beyond the client's timeout = a stall)
  NNN             HTTP status NNN with an OpenAI-style error body (500, 503, 429, 400, 404, ...)
  reset           drop the TCP connection without an answer (RST)
  malformed       200 with a truncated JSON body
  schema          200 with valid JSON that is not a chat completion (no `choices`)
  notokens        200, a chat completion without token ids (a server ignoring return_token_ids)
  length          an answer cut by max_tokens (finish_reason "length", no </think>, no content)
  exit            the server process dies on the spot (a crash; restart it to continue)

Start-up, as a vLLM that is still loading and the servers that are not vLLM (common/server_wait.py):
  --start-after S   the port listens only after S seconds (connections refused until then)
  --loading S       for S seconds from the first GET, /health answers 503 and /v1/models --loading-status
  --no-health       no /health route (404 there: not vLLM); otherwise /health is 200 once ready
  --models-html     /v1/models answers 200 with a proxy's HTML page
Every request is also logged with its `method` and `path` (FaultServer.gets()).

A simulated KV cache, for 01b --concurrency auto (its gauges move with the load it is given):
  --kv-slots N      /metrics serves vLLM's load gauges as if the cache held N answers: with k requests
                    in flight, running min(k, N), waiting k - N, kv_cache_usage_perc min(1, k/N); an
                    answer arriving over N preempts k - N (num_preemptions_total + k - N) and every answer is
                    slowed by (k/N)^2 beyond N (the recompute: fewer tokens/s than at N); generation_tokens_total
                    counts the answers' tokens. Without it there is no /metrics (404), as on a server that is not vLLM.

With `--tokenizer DIR` the ids are the real ones of that tokenizer (the prompt rendered with its
chat template, the answer as the target would emit it); otherwise they are stand-in ids.
`--instant` answers every request with the same precomputed bytes (the client benchmark).

    python tests/fault_server.py --port 8123 --schedule "500,reset,ok" --log /tmp/faults.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import re
import socket
import struct
import sys
import time

from aiohttp import web

DIRECTIVE = re.compile(r"\[\[fault:([^\]]*)\]\]")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1", help="listen address (default: 127.0.0.1)")
    p.add_argument("--port", type=int, required=True, help="listen port")
    p.add_argument("--model", default="fake", help="served model name (default: fake)")
    p.add_argument("--schedule", default="", help="comma-separated behaviours by arrival order (default: all ok)")
    p.add_argument("--cycle", action="store_true", help="repeat --schedule instead of ok after it")
    p.add_argument("--delay", type=float, default=0.0, help="seconds added to every answer (default: 0)")
    p.add_argument("--tokenizer", default=None, help="tokenizer dir for real ids (default: stand-in ids)")
    p.add_argument("--reasoning-words", type=int, default=12, help="length of the fake reasoning (default: 12)")
    p.add_argument("--heal", action="store_true", help="ignore directives and --schedule: all ok (a fixed server)")
    p.add_argument("--instant", action="store_true", help="same precomputed answer to everything (benchmarks)")
    p.add_argument("--log", default=None, help="append one JSON line per request here (default: none)")
    p.add_argument("--kv-slots", type=int, default=0,
                   help="serve vLLM gauges of a cache holding N answers (default: none)")
    p.add_argument("--start-after", type=float, default=0.0, help="seconds before the port listens (default: 0)")
    p.add_argument("--loading", type=float, default=0.0,
                   help="seconds of /health 503 and /v1/models --loading-status from the first GET (default: 0)")
    p.add_argument("--loading-status", type=int, default=503, help="/v1/models' status while --loading (default: 503)")
    p.add_argument("--no-health", action="store_true", help="no /health route: a server that is not vLLM")
    p.add_argument("--models-html", action="store_true", help="/v1/models answers 200 with an HTML page")
    return p.parse_args(argv)


class Faults:
    def __init__(self, args):
        self.args = args
        self.schedule = [s.strip() for s in args.schedule.split(",") if s.strip()]
        self.arrivals = 0
        self.seen: dict[str, int] = {}
        self.log = open(args.log, "a") if args.log else None
        self.fmt = None
        if args.tokenizer:  # real ids are the project's own re-wrap, the one place that joins them
            from eagle3_train.common.tokenization import ChatFormat
            from transformers import AutoTokenizer

            self.fmt = ChatFormat.from_tokenizer(AutoTokenizer.from_pretrained(args.tokenizer))

    def behaviour(self, text: str) -> str:
        n = self.arrivals
        self.arrivals += 1
        if self.args.heal:
            return "ok"
        m = DIRECTIVE.search(text)
        if m:
            steps = [s.strip() for s in m.group(1).split(",") if s.strip()] or ["ok"]
            k = self.seen.get(text, 0)
            self.seen[text] = k + 1
            return steps[min(k, len(steps) - 1)]
        if self.schedule:
            if self.args.cycle:
                return self.schedule[n % len(self.schedule)]
            if n < len(self.schedule):
                return self.schedule[n]
        return "ok"

    def record(self, **kw) -> None:
        if self.log:
            self.log.write(json.dumps({"t": time.time(), **kw}) + "\n")
            self.log.flush()

    # -- answers ---------------------------------------------------------------------------------

    def texts(self, text: str, truncated: bool) -> tuple[str, str | None]:
        h = hashlib.sha256(text.encode()).hexdigest()
        words = [f"w{h[i:i + 3]}" for i in range(0, 3 * self.args.reasoning_words, 3)]
        reasoning = "I think about it: " + " ".join(words) + "."
        if truncated:
            return reasoning[: len(reasoning) // 2], None
        return reasoning, f"The answer is {h[:8]}."

    def ids(self, messages: list, reasoning: str, content: str | None, truncated: bool):
        if self.fmt is None:  # stand-in ids: deterministic, small, not a real tokenization
            flat = " ".join(str(m.get("content", "")) for m in messages)
            prompt = [b % 250 for b in flat.encode()][:512] or [1]
            gen = [b % 250 for b in (reasoning + (content or "")).encode()]
            return prompt, gen + ([] if truncated else [250])
        return self.fmt.rewrap(messages, reasoning, content, "length" if truncated else "stop")

    def completion(self, body: dict, truncated: bool = False, with_ids: bool = True) -> dict:
        messages = body.get("messages") or []
        text = str(messages[-1].get("content", "")) if messages else ""
        reasoning, content = self.texts(text, truncated)
        prompt_ids, gen_ids = self.ids(messages, reasoning, content, truncated)
        choice = {"index": 0, "message": {"role": "assistant", "content": content, "reasoning": reasoning,
                                          "tool_calls": []},
                  "finish_reason": "length" if truncated else "stop", "logprobs": None}
        out = {"id": "chatcmpl-" + hashlib.md5(text.encode()).hexdigest()[:12], "object": "chat.completion",
               "created": int(time.time()), "model": body.get("model", self.args.model), "choices": [choice],
               "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(gen_ids),
                         "total_tokens": len(prompt_ids) + len(gen_ids)}}
        if with_ids:
            choice["token_ids"] = gen_ids
            out["prompt_token_ids"] = prompt_ids
        return out


def _error(status: int, message: str) -> web.Response:
    body = {"error": {"message": message, "type": "FakeError", "code": status}}
    return web.json_response(body, status=status)


def _reset(request: web.Request) -> None:
    """Close with SO_LINGER 0, so the client sees a connection reset, not a clean close."""
    transport = request.transport
    sock = transport.get_extra_info("socket") if transport else None
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    if transport is not None:
        transport.abort()


def build_app(args) -> web.Application:
    faults = Faults(args)
    first_get: list[float] = []

    def loading() -> bool:
        # --loading counts from the first GET, so the client's first probe sees the server loading
        # however long that client took to start
        if not first_get:
            first_get.append(time.monotonic())
        return time.monotonic() < first_get[0] + args.loading
    instant = json.dumps(faults.completion({"model": args.model, "messages": [
        {"role": "user", "content": "benchmark"}]})).encode()

    @web.middleware
    async def log_paths(request, handler):  # every request, routed or not (a wrong path is a 404 here)
        faults.record(method=request.method, path=request.path, loading=loading())
        return await handler(request)

    app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=[log_paths])

    async def models(_request):
        if loading():
            return _error(args.loading_status, "loading")
        if args.models_html:
            return web.Response(text="<html><body><h1>Welcome</h1></body></html>", content_type="text/html")
        return web.json_response({"object": "list", "data": [{"id": args.model, "object": "model"}]})

    async def health(_request):
        return web.Response(status=503 if loading() else 200)

    load = {"active": 0, "preemptions": 0, "generated": 0}

    async def metrics(_request):
        k, n = load["active"], args.kv_slots
        text = "".join(f'{name}{{engine="0",model_name="{args.model}"}} {value}\n' for name, value in (
            ("vllm:num_requests_running", min(k, n)), ("vllm:num_requests_waiting", max(0, k - n)),
            ("vllm:kv_cache_usage_perc", min(1.0, k / n)), ("vllm:num_preemptions_total", float(load["preemptions"])),
            ("vllm:generation_tokens_total", float(load["generated"]))))
        return web.Response(text=text, content_type="text/plain")

    async def chat(request: web.Request):
        if not args.kv_slots:
            return await answer(request)
        load["active"] += 1
        try:
            if load["active"] > args.kv_slots:
                load["preemptions"] += load["active"] - args.kv_slots
            response = await answer(request)
            if response.status == 200 and response.body:
                gen = json.loads(response.body).get("choices", [{}])[0].get("token_ids") or []
                load["generated"] += len(gen)
            return response
        finally:
            load["active"] -= 1

    async def answer(request: web.Request):
        if args.instant:
            await request.read()
            return web.Response(body=instant, content_type="application/json")
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(400, "request body is not JSON")
        messages = body.get("messages") or []
        text = str(messages[-1].get("content", "")) if messages else ""
        what = faults.behaviour(text)
        faults.record(behaviour=what, text=text[:200], return_token_ids=body.get("return_token_ids"))
        if body.get("model") != args.model:
            return _error(404, f"The model `{body.get('model')}` does not exist.")
        if args.delay:
            await asyncio.sleep(args.delay * max(1.0, load["active"] / args.kv_slots if args.kv_slots else 1.0) ** 2)
        if what.startswith("delay="):
            await asyncio.sleep(float(what.split("=", 1)[1]))
            what = "ok"
        if what.isdigit():
            return _error(int(what), f"injected HTTP {what}")
        if what == "reset":
            _reset(request)
            raise asyncio.CancelledError  # nothing more to send on a dead connection
        if what == "exit":
            os._exit(3)
        if what == "malformed":
            return web.Response(body=b'{"id": "chatcmpl-x", "choices": [{"index": 0, "mess',
                                content_type="application/json")
        if what == "schema":
            return web.json_response({"id": "x", "object": "chat.completion", "result": "no choices here"})
        if what in ("ok", "length", "notokens"):
            return web.json_response(faults.completion(body, truncated=what == "length",
                                                       with_ids=what != "notokens"))
        return _error(500, f"fault_server: unknown behaviour {what!r}")

    app.router.add_get("/v1/models", models)
    if not args.no_health:
        app.router.add_get("/health", health)
    app.router.add_post("/v1/chat/completions", chat)
    if args.kv_slots:
        app.router.add_get("/metrics", metrics)
    return app


def main(argv=None) -> int:
    args = parse_args(argv)
    time.sleep(args.start_after)  # the port refuses connections meanwhile, as while vLLM loads
    print(f"fault_server listening on http://{args.host}:{args.port}/v1 (pid {os.getpid()})", flush=True)
    web.run_app(build_app(args), host=args.host, port=args.port, print=None, access_log=None,
                backlog=4096, reuse_address=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
