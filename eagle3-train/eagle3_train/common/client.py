"""The chat client of 01b: the openai SDK against one or more vLLM endpoints, with our own retries.

Why it looks the way it does:
- Requests go through the SDK's `post(..., cast_to=httpx2.Response)` with a body we serialise
  ourselves, and the JSON answer is read as a dict: vLLM's extra fields (`prompt_token_ids`,
  `choices[0].token_ids`, `message.reasoning`) are what we need, and skipping the SDK's pydantic
  request transform and response models is most of its per-request CPU (scripts/bench/client.py).
- The SDK's own retries are off (`max_retries=0`): ours count attempts per sample, move a retry to
  another endpoint, and separate what is worth retrying (timeouts, connection errors, 408/409/429,
  5xx, a garbled body) from what is not (other 4xx, an answer without token ids).
- The HTTP layer is aiohttp behind an httpx2 transport (`LeanAiohttpTransport`): one pooled session
  sized to the concurrency, the whole body read at once, and aiohttp's errors mapped to the right
  httpx2 ones (the SDK's vendored transport reports a reset connection as a connect *timeout*).
- `timeout` bounds one attempt end to end (asyncio deadline), not the gap between two reads:
  a server that trickles bytes cannot hold a slot forever. The default is an hour because one
  8K-token reasoning answer at concurrency 200 can take many minutes (the seeds' 60 s lost 8%).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

from eagle3_train.common.errors import PipelineError

RETRYABLE_STATUS = frozenset({408, 409, 429})
OK_FINISH = ("stop", "length")


def is_retryable_status(status: int) -> bool:
    return status in RETRYABLE_STATUS or status >= 500


def backoff_delay(attempt: int, base: float, cap: float, rng: random.Random,
                  retry_after: float | None = None) -> float:
    """Seconds to wait before retry number `attempt` (1, 2, ...): exponential with jitter.

    Half of the exponential step is fixed and half random ("equal jitter"), so a burst of
    failures does not come back as a burst; a server's Retry-After, if longer, wins (capped)."""
    step = min(cap, base * (2 ** (attempt - 1)))
    delay = step / 2 + rng.uniform(0, step / 2)
    if retry_after is not None and retry_after > delay:
        delay = min(cap, retry_after)
    return delay


@dataclass
class Outcome:
    """One sample's final result: `answer` (fields for raw_responses.jsonl) or `error`."""

    answer: dict | None = None
    error: dict | None = None
    attempts: int = 0
    endpoint: str | None = None
    latency_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.answer is not None


class ResponseError(Exception):
    """The server answered 200 but not with a usable chat completion."""

    def __init__(self, kind: str, message: str, retryable: bool):
        super().__init__(message)
        self.kind, self.retryable = kind, retryable


def parse_completion(data: bytes, require_token_ids: bool = True) -> dict:
    """A vLLM chat completion body -> the fields 01b stores. Raises ResponseError. With
    require_token_ids=False an answer without ids comes back with both id fields None."""
    try:
        d = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ResponseError("bad_json", f"response is not valid JSON ({e}): {data[:120]!r}", True) from None
    choices = d.get("choices") if isinstance(d, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise ResponseError("bad_schema", f"response has no choices: {str(d)[:160]}", False)
    choice = choices[0]
    msg = choice.get("message")
    if not isinstance(msg, dict):
        raise ResponseError("bad_schema", "choices[0] has no message", False)
    token_ids, prompt_ids = choice.get("token_ids"), d.get("prompt_token_ids")
    if (token_ids is None or prompt_ids is None) and not require_token_ids:
        token_ids = prompt_ids = None
    elif token_ids is None or prompt_ids is None:
        raise ResponseError("no_token_ids", "the server returned no token ids for return_token_ids=true "
                            "(it needs a vLLM that supports return_token_ids; or pass --allow-text-fallback "
                            "to re-wrap the text into ids, inexactly)", False)
    # Only the ends are checked here (8K-token answers; this runs in the event loop); every id is
    # range-checked against the tokenizer when the answers are tokenized.
    if token_ids is not None and not (isinstance(token_ids, list) and isinstance(prompt_ids, list)
            and all(type(t) is int for t in (*token_ids[:1], *token_ids[-1:], *prompt_ids[:1], *prompt_ids[-1:]))):
        raise ResponseError("bad_schema", "token_ids / prompt_token_ids are not lists of ints", False)
    finish = choice.get("finish_reason")
    if finish not in OK_FINISH:
        raise ResponseError(f"finish_{finish}", f"generation ended with finish_reason={finish!r}", True)
    reasoning = msg.get("reasoning")
    if reasoning is None:
        reasoning = msg.get("reasoning_content")  # older vLLM name of the same field
    return {"reasoning": reasoning, "content": msg.get("content"), "prompt_token_ids": prompt_ids,
            "token_ids": token_ids, "finish_reason": finish, "usage": d.get("usage"),
            "model": d.get("model")}


# ----------------------------------------------------------------------------- HTTP layer

# Seconds an idle connection is kept for reuse: under the server's own keep-alive (vLLM closes idle
# connections after VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s), so a request never goes out on a connection
# the server is closing, which fails as a disconnect and costs a retry.
KEEPALIVE_S = 4.0


def _lean_transport_class():
    import aiohttp
    import httpx2

    class LeanAiohttpTransport(httpx2.AsyncBaseTransport):
        """httpx2 transport over one aiohttp session; reads whole bodies; maps errors faithfully."""

        def __init__(self, limit: int, connect_timeout: float):
            self.limit = limit
            self.timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout)
            self.session: aiohttp.ClientSession | None = None

        async def handle_async_request(self, request):
            if self.session is None:
                self.session = aiohttp.ClientSession(
                    connector=aiohttp.TCPConnector(limit=self.limit, limit_per_host=0, force_close=False,
                                                   keepalive_timeout=KEEPALIVE_S),
                    timeout=self.timeout, auto_decompress=True,
                    skip_auto_headers=("User-Agent",))
            try:
                async with self.session.request(request.method, str(request.url), data=request.content or None,
                                                headers=request.headers, allow_redirects=False) as r:
                    body = await r.read()
                    return httpx2.Response(r.status, headers=r.raw_headers, content=body, request=request)
            except aiohttp.ClientConnectorError as e:
                raise httpx2.ConnectError(f"{type(e).__name__}: {e}", request=request) from e
            except (aiohttp.ServerTimeoutError, TimeoutError) as e:
                raise httpx2.ReadTimeout(f"{type(e).__name__}: {e}", request=request) from e
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError) as e:
                raise httpx2.RemoteProtocolError(f"{type(e).__name__}: {e}", request=request) from e
            except (aiohttp.ClientError, OSError) as e:
                raise httpx2.ReadError(f"{type(e).__name__}: {e}", request=request) from e

        async def aclose(self):
            if self.session is not None:
                await self.session.close()
                self.session = None

    return LeanAiohttpTransport


def make_openai_client(base_url: str, *, api_key: str, transport: str = "aiohttp",
                       concurrency: int = 256, connect_timeout: float = 30.0, http_client=None):
    """An `openai.AsyncOpenAI` for one endpoint, set up for many small raw requests."""
    import httpx2
    import openai

    if http_client is None:
        if transport == "aiohttp":
            http_client = httpx2.AsyncClient(transport=_lean_transport_class()(concurrency + 8, connect_timeout),
                                             timeout=None)
        elif transport == "httpx":
            http_client = openai.DefaultAsyncHttpxClient(
                timeout=None, limits=httpx2.Limits(max_connections=concurrency + 8,
                                                   max_keepalive_connections=concurrency + 8,
                                                   keepalive_expiry=KEEPALIVE_S))
        else:
            raise PipelineError(f"--transport must be aiohttp or httpx, not {transport!r}")
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=None,
                                http_client=http_client)
    # The SDK's telemetry headers (X-Stainless-*) are a dozen headers to build and parse per request.
    return client.with_options(default_headers={k: openai.omit for k in client.default_headers
                                                if k.lower().startswith("x-stainless")})


# ----------------------------------------------------------------------------- client

@dataclass
class Endpoint:
    url: str
    client: object
    inflight: int = 0
    ok: int = 0
    failed: int = 0
    max_model_len: int | None = None  # what /models says (vLLM's field), set by the preflight


@dataclass
class ChatClient:
    """`async with ChatClient(urls, model) as c: outcome = await c.complete(body)`."""

    base_urls: list[str]
    model: str
    timeout: float = 3600.0
    max_retries: int = 5
    backoff_base: float = 1.0
    backoff_max: float = 60.0
    connect_timeout: float = 30.0
    api_key: str = "EMPTY"
    concurrency: int = 64
    transport: str = "aiohttp"
    seed: int | None = None
    require_token_ids: bool = True  # False: 01b --allow-text-fallback re-wraps answers without ids
    endpoints: list[Endpoint] = field(default_factory=list, init=False)
    retries: int = field(default=0, init=False)
    retry_causes: dict = field(default_factory=dict, init=False)  # error_type -> {count, first}: what was retried

    def __post_init__(self):
        if not self.base_urls:
            raise PipelineError("no --base-url given")
        self._rng = random.Random(self.seed)

    async def __aenter__(self):
        self.endpoints = [Endpoint(u.rstrip("/"), make_openai_client(
            u.rstrip("/"), api_key=self.api_key, transport=self.transport, concurrency=self.concurrency,
            connect_timeout=self.connect_timeout)) for u in self.base_urls]
        return self

    async def __aexit__(self, *exc):
        for ep in self.endpoints:
            try:
                await ep.client.close()
            except Exception:  # closing after a crash or a cancel must not hide the real error
                pass

    # -- requests ---------------------------------------------------------------------------------

    def body(self, messages: list[dict], sampling: dict, *, chat_template_kwargs: dict | None = None,
             extra_body: dict | None = None) -> bytes:
        """The request body; vLLM fields ride along, and token ids are always asked for."""
        # vLLM's slow-tokenizer detokenizer (Kimi's tiktoken one) puts spaces around added tokens
        # by default (vllm/tokenizers/detokenizer_utils.py), so the text would never re-tokenize
        # to the returned ids; fast tokenizers are unaffected. --extra-body may override it.
        b = {"model": self.model, "messages": messages, "spaces_between_special_tokens": False}
        b.update({k: v for k, v in sampling.items() if v is not None})
        if chat_template_kwargs:
            b["chat_template_kwargs"] = chat_template_kwargs
        if extra_body:
            b.update(extra_body)
        b["return_token_ids"] = True
        return json.dumps(b, ensure_ascii=False).encode()

    def _pick(self, avoid: Endpoint | None) -> Endpoint:
        # Fewest requests in flight: a slow or stalled endpoint holds more, so gets fewer new ones.
        cands = [e for e in self.endpoints if e is not avoid] or self.endpoints
        return min(cands, key=lambda e: e.inflight)

    async def _attempt(self, ep: Endpoint, body: bytes) -> dict:
        import httpx2

        # An absolute URL: the SDK then parses it once instead of merging it with base_url.
        resp = await ep.client.post(ep.url + "/chat/completions", cast_to=httpx2.Response, content=body,
                                    options={"headers": {"Content-Type": "application/json"}})
        return self.parse(resp.content)

    def parse(self, content: bytes) -> dict:
        """A response body -> the answer 01b stores (a subclass may keep more of it)."""
        return parse_completion(content, self.require_token_ids)

    async def complete(self, body: bytes, prefer: Endpoint | None = None) -> Outcome:
        """Send one request, retrying what is worth retrying; never raises for server trouble.
        `prefer`: the endpoint of the first attempt (01b --concurrency auto's per-endpoint levels);
        a retry still moves to another endpoint."""
        t0 = time.monotonic()
        ep = None
        last: dict = {}
        for attempt in range(1, self.max_retries + 2):
            ep = prefer if attempt == 1 and prefer is not None else \
                self._pick(ep if len(self.endpoints) > 1 and last else None)
            ep.inflight += 1
            try:
                async with asyncio.timeout(self.timeout):
                    answer = await self._attempt(ep, body)
                ep.ok += 1
                return Outcome(answer=answer, attempts=attempt, endpoint=ep.url,
                               latency_s=round(time.monotonic() - t0, 3))
            except Exception as e:  # classified below; anything unknown is re-raised
                last = classify(e, self.timeout)
                ep.failed += 1
            finally:
                ep.inflight -= 1
            if not last["retryable"] or attempt > self.max_retries:
                break
            self.retries += 1
            cause = self.retry_causes.setdefault(last["error_type"], {"count": 0, "first": last["message"]})
            cause["count"] += 1
            await asyncio.sleep(backoff_delay(attempt, self.backoff_base, self.backoff_max, self._rng,
                                              last.pop("retry_after", None)))
        last.pop("retry_after", None)
        return Outcome(error={**last, "attempts": attempt, "endpoint": ep.url}, attempts=attempt,
                       endpoint=ep.url, latency_s=round(time.monotonic() - t0, 3))

    async def preflight(self) -> list[str]:
        """Check each endpoint serves `model`; returns warnings, raises if none is usable."""
        warnings, usable, answered = [], 0, False
        for ep in self.endpoints:
            try:
                async with asyncio.timeout(min(self.timeout, 30)):
                    page = await ep.client.models.list()
                ids = [m.id for m in page.data]
            except Exception as e:
                problem, reached = _preflight_problem(e, ep.url)
                answered |= reached
                warnings.append(problem if reached else f"{ep.url}: {problem}")
                continue
            if self.model not in ids:
                raise PipelineError(f"{ep.url} does not serve model {self.model!r} (it serves: "
                                    f"{', '.join(ids) or 'nothing'}); pass --model with one of those")
            card = page.data[ids.index(self.model)]
            ep.max_model_len = getattr(card, "max_model_len", None)  # an extra field of vLLM's model card
            usable += 1
        if not usable:
            head = "no endpoint is usable" if answered else "no endpoint is reachable"
            raise PipelineError(f"{head}: " + "; ".join(warnings))
        return warnings

    async def metrics(self, endpoints: list[Endpoint] | None = None,
                      timeout: float = 30.0) -> list[tuple[Endpoint, str | None, str | None]]:
        """Each endpoint's (default: all) Prometheus text at server_metrics.metrics_url, as (endpoint,
        text, None), or (endpoint, None, why) where there is none (404: not vLLM; unreachable); never
        raises for server trouble."""
        import httpx2

        from eagle3_train.common.server_metrics import metrics_url

        out = []
        for ep in self.endpoints if endpoints is None else endpoints:
            try:
                async with asyncio.timeout(min(self.timeout, timeout)):
                    resp = await ep.client.get(metrics_url(ep.url), cast_to=httpx2.Response)
                out.append((ep, resp.text, None))
            except Exception as e:  # noqa: BLE001 - any failure is a missing figure, not a failed run
                try:
                    c = classify(e, min(self.timeout, timeout))
                    why = f"HTTP {c['status']}" if c["status"] else c["message"]
                except Exception:  # noqa: BLE001
                    why = f"{type(e).__name__}: {_one_line(e, 120)}"
                out.append((ep, None, why))
        return out


def classify(exc: BaseException, timeout: float) -> dict:
    """An exception from one attempt -> {error_type, message, status, retryable[, retry_after]}."""
    import openai

    if isinstance(exc, ResponseError):
        return {"error_type": exc.kind, "message": str(exc), "status": 200, "retryable": exc.retryable}
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError, openai.APITimeoutError)):
        return {"error_type": "timeout", "message": f"no complete answer within {timeout:g} s (--timeout)",
                "status": None, "retryable": True}
    if isinstance(exc, openai.APIStatusError):
        status = exc.status_code
        out = {"error_type": f"http_{status}", "message": _one_line(exc.message), "status": status,
               "retryable": is_retryable_status(status)}
        ra = exc.response.headers.get("retry-after") if exc.response is not None else None
        if ra:
            try:
                out["retry_after"] = float(ra)
            except ValueError:
                pass
        return out
    if isinstance(exc, openai.APIConnectionError):
        cause = exc.__cause__
        detail = f"{cause}" if cause is not None else str(exc)
        return {"error_type": "connection", "message": _one_line(detail), "status": None, "retryable": True}
    raise exc


def _preflight_problem(exc: Exception, url: str) -> tuple[str, bool]:
    """Why GET <url>/models failed, in words, and whether the server answered at all: unreachable,
    an HTTP status (404: the base URL's path is wrong, usually a missing /v1), or an answer that is
    not the OpenAI schema (a proxy's HTML page: the SDK hands back a str and fails inside its pager)."""
    try:
        c = classify(exc, 30)
    except Exception:  # noqa: BLE001 - anything else is an answer we cannot read
        return (f"{url}: GET /models did not answer in the OpenAI schema "
                f"({type(exc).__name__}: {_one_line(exc, 120)})", True)
    status = c["status"]
    if status is None:
        return f"not reachable ({c['message']})", False
    where = f"the server answered {status} at {url}/models"
    if status == 404:
        return f"{where} (wrong path? the base URL must end in /v1, e.g. http://host:8000/v1)", True
    if status in (401, 403):
        return f"{where} ({_one_line(c['message'], 160)}): check --api-key", True
    return f"{where} ({_one_line(c['message'], 160)})", True


def _one_line(s: str, limit: int = 300) -> str:
    s = " ".join(str(s).split())
    return s if len(s) <= limit else s[: limit - 3] + "..."
