"""Waiting for a server given by URL that is still loading (01b --base-url, 02 --server-url, 05
--base-url / --url): `vllm serve ... &` and the stage can be started together.

A cold load of a 1T target takes about half an hour. While vLLM loads, its port refuses connections
(it binds the socket early but listens only once the engine is up), and a server behind a proxy or
a newer build may answer with 5xx at /health and 404/503 at /v1/models. vLLM answers GET /health
with 200 once it is ready. Each probe is one GET <url>/models, read as the preflight reads it,
and, only when that fails with an HTTP status, one GET /health beside /v1:

  /models in the OpenAI schema                       ready: go on
  /models: no answer (refused, reset, timed out)     loading: wait
  /models: HTTP status, /health no answer or 5xx     loading: wait
  /models: HTTP status, /health answers otherwise    answered: stop waiting (200: /models is the
                                                     wrong path or key; 404: not vLLM)
  /models answers in another schema (HTML, ...)      answered: stop waiting

(/health 200 gets /models asked once more first: the server may have finished loading between the
two GETs.)

A server that answered is left to the stage's own check (01b's preflight, 05's model list, 02's
first request), so its one-line error is the same as without the wait. The wait only ever
raises when no server is ready by the deadline, in one line naming --wait-for-server.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import errno
import math
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from urllib.parse import urlsplit

from eagle3_train.common.errors import PipelineError

WAIT_DEFAULT_S = 3600.0  # a cold Kimi-K2.5 INT4 load (~554 GB) takes ~28 minutes; twice that is slack enough
WAIT_HELP = ("seconds to wait for a server at the URL that is still loading (port refused, or vLLM's /health "
             "not yet 200), with a line every 30 s; a server that answers but is not vLLM's OpenAI API is "
             f"refused at once; 0 = do not wait (default: {WAIT_DEFAULT_S:.0f}, a cold 1T load)")
LINE_EVERY_S = 30.0
POLL_S = 2.0
PROBE_TIMEOUT_S = 10.0  # one GET; a loading server refuses at once, a hung one must not stall the lines

READY, LOADING, ANSWERED = "ready", "loading", "answered"


def check_wait(seconds: float) -> None:
    """validate()'s check of --wait-for-server (each stage that has it)."""
    if isinstance(seconds, str):  # what wait_seconds could not read
        raise PipelineError(f"--wait-for-server {seconds!r} is not a number of seconds: pass e.g. 1800 for 30 "
                            "minutes, 3600 for an hour")
    if not seconds >= 0:  # NaN too
        raise PipelineError(f"--wait-for-server must not be negative (0 = do not wait), not {seconds}")
    if math.isinf(seconds):  # the wait's lines count it down in minutes
        raise PipelineError("--wait-for-server takes seconds, not inf: pass a bound, e.g. 86400 (a day)")


def wait_seconds(text: str) -> float | str:
    """argparse's type of --wait-for-server: the number, else the text as given, which check_wait then
    refuses in the stages' one `error:` line (argparse's own line would not say what to pass)."""
    try:
        return float(text)
    except ValueError:
        return text


def check_url(flag: str, url: str) -> None:
    """validate()'s check of a server URL: http(s)://host..., what the client and the wait can reach
    (without the scheme aiohttp takes 'host:8000' as a path, and says so only once it is asked)."""
    parts = urlsplit(url)
    if parts.scheme in ("http", "https") and parts.hostname:
        return
    fix = f"write http://{url.split('://', 1)[-1].lstrip('/')}" if url.strip() else "pass e.g. http://127.0.0.1:8000/v1"
    raise PipelineError(f"{flag} {url!r} is not an http(s) URL with a host: {fix}")


def health_url(base_url: str) -> str:
    """http://host:8000/v1 -> http://host:8000/health (vLLM serves /health beside /v1, not in it)."""
    root = base_url.rstrip("/")
    return (root[:-3] if root.endswith("/v1") else root) + "/health"


def judge(models_status: int | None, health_status: int | None = None, *, schema: bool = False) -> str:
    """LOADING or ANSWERED for a GET /models that did not give a model list: `models_status` None =
    no answer at all, else its HTTP status (`schema`: it answered 200 in another schema);
    `health_status` None = GET /health got no answer (or was not asked)."""
    if schema:
        return ANSWERED
    if models_status is None:
        return LOADING
    if health_status is None or health_status >= 500:
        return LOADING
    return ANSWERED


def span(seconds: float) -> str:
    """270 -> '4m30s', 3600 -> '60m', 45 -> '45s'."""
    s = int(seconds)
    m, s = divmod(s, 60)
    if not m:
        return f"{s}s"
    return f"{m}m" if not s else f"{m}m{s:02d}s"


def log_line(stage: str, log_path: Path | None) -> Callable[[str], None]:
    """A `say` for wait_for_servers: the line on stderr and, timestamped, in the stage's progress.log."""
    def say(text: str) -> None:
        print(f"{stage}: {text}", file=sys.stderr, flush=True)
        if log_path is not None and Path(log_path).parent.is_dir():
            now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
            with open(log_path, "a") as f:
                f.write(f"{now} {stage} {text}\n")
    return say


def _no_answer(exc: BaseException) -> str:
    """Why a request got no HTTP answer, in a few words."""
    seen, depth = exc, 0
    while seen is not None and depth < 8:
        if isinstance(seen, ConnectionRefusedError) or getattr(seen, "errno", None) == errno.ECONNREFUSED:
            return "connection refused"
        if isinstance(seen, TimeoutError):
            return f"no answer in {PROBE_TIMEOUT_S:g} s"
        seen, depth = seen.__cause__ or seen.__context__, depth + 1
    from eagle3_train.common.client import _one_line

    return f"no answer: {_one_line(str(exc), 100)}"


def _status(exc: Exception) -> tuple[int | None, bool, str]:
    """(HTTP status or None, answered in another schema, words) for a failed GET."""
    from eagle3_train.common.client import classify

    try:
        c = classify(exc, PROBE_TIMEOUT_S)
    except Exception:  # noqa: BLE001 - an answer the SDK cannot read: another schema
        return 200, True, "not the OpenAI schema"
    if c["status"] is None:
        return None, False, _no_answer(exc)
    return c["status"], False, str(c["status"])


async def probe(client, url: str) -> tuple[str, str]:
    """(READY | LOADING | ANSWERED, the server's state in words) from one GET /models (+ /health)."""
    import httpx2

    async def models() -> tuple[int | None, bool, str] | None:
        """None: a model list; else _status of the failure."""
        try:
            async with asyncio.timeout(PROBE_TIMEOUT_S):
                page = await client.models.list()
            [m.id for m in page.data]  # read as the preflight reads it: a page it cannot read is another schema
            return None
        except Exception as e:  # noqa: BLE001 - sorted by _status; Ctrl-C (CancelledError) is not an Exception
            return _status(e)

    failed = await models()
    if failed is None:
        return READY, "ready"
    status, schema, words = failed
    if status is None or schema:
        return judge(status, schema=schema), words
    try:
        async with asyncio.timeout(PROBE_TIMEOUT_S):
            await client.get(health_url(url), cast_to=httpx2.Response)
        health, hwords = 200, "200"
    except Exception as e:  # noqa: BLE001
        health, _, hwords = _status(e)
    if health == 200 and await models() is None:  # asked once more: it may have finished loading between the GETs
        return READY, "ready"
    return judge(status, health), f"/models {words}, /health {hwords}"


async def wait_for_servers(urls: Sequence[str], wait_s: float, *, api_key: str = "EMPTY",
                           say: Callable[[str], None] | None = None, every_s: float = LINE_EVERY_S,
                           poll_s: float = POLL_S) -> dict[str, str]:
    """Return once no URL is loading (each is ready, or answered in a way the stage's own check
    judges), with a line per loading URL at once and every `every_s` seconds; after `wait_s`,
    return if one is ready (the stage's check names the rest), else raise one line naming
    --wait-for-server. `wait_s` 0: return at once, asking nothing. Returns {url: state}."""
    if wait_s <= 0:
        return {}
    from eagle3_train.common.client import make_openai_client

    say = say or (lambda text: print(text, file=sys.stderr, flush=True))
    clients = {u: make_openai_client(u.rstrip("/"), api_key=api_key, concurrency=1, connect_timeout=PROBE_TIMEOUT_S)
               for u in dict.fromkeys(urls)}
    states: dict[str, tuple[str, str]] = {}
    t0 = time.monotonic()
    next_line = t0
    try:
        while True:
            pending = [u for u in clients if states.get(u, (LOADING,))[0] == LOADING]
            found = await asyncio.gather(*(probe(clients[u], u.rstrip("/")) for u in pending))
            states.update(zip(pending, found))
            loading = [u for u in pending if states[u][0] == LOADING]
            if not loading:
                return {u: s for u, (s, _) in states.items()}
            now = time.monotonic()
            elapsed = now - t0
            if elapsed >= wait_s:
                if any(s == READY for s, _ in states.values()):
                    return {u: s for u, (s, _) in states.items()}
                raise PipelineError(f"{', '.join(loading)} not ready after {wait_s:g} s (--wait-for-server); last: "
                                    f"{states[loading[0]][1]}; start the server, or raise --wait-for-server "
                                    "if it is still loading")
            if now >= next_line:
                for u in loading:
                    say(f"waiting for {u} (loading: {states[u][1]}) {span(elapsed)} of {span(wait_s)}")
                next_line = now + every_s
            await asyncio.sleep(min(poll_s, wait_s - elapsed))
    finally:
        for c in clients.values():
            try:
                await c.close()
            except Exception:  # noqa: BLE001 - closing must not hide the real outcome
                pass
