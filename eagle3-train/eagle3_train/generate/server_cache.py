"""01b's look at the servers' KV caches before any prompt goes out: how many answers each holds
whole at --max-tokens, and a warning when a fixed --concurrency asks for more (vLLM would preempt
and recompute answers)."""

from __future__ import annotations

import math

from eagle3_train.common.client import ChatClient
from eagle3_train.common.prompts import Prompt
from eagle3_train.common.server_metrics import CACHE_INFO, cache_tokens, fitting_concurrency, metrics_url

CHARS_PER_TOKEN = 4.0  # assumed, for the prompt estimate only (BPE on English; the answers dominate)


def prompt_tokens_estimate(prompts: list[Prompt]) -> int:
    """The mean prompt in tokens, from its messages' characters (CHARS_PER_TOKEN), rounded up."""
    chars = sum(len(str(m.get("content") or "")) for p in prompts for m in p.messages)
    return math.ceil(chars / CHARS_PER_TOKEN / max(1, len(prompts)))


def cache_report(figures: list[tuple[str, int | None, int | None, str | None]], concurrency: int | None, prompt: int,
                 max_tokens: int | None) -> tuple[list[str], dict]:
    """What 01b says about the servers' KV caches before sending prompts: lines to print (a
    `warning:` when --concurrency x (prompt + max tokens) exceeds a server's cache, naming the
    concurrency that fits; a `note:` where a server gives no figures) and the record for the
    manifest. `figures`: per endpoint (url, cache tokens, max_model_len, why there are none).
    The client spreads requests evenly (fewest in flight first), so each server holds its share.
    `concurrency` None (auto): no warning, and no note where figures are missing (the controller
    says what it does with such a server)."""
    share = math.ceil(concurrency / len(figures)) if concurrency else None
    lines, endpoints, fits = [], {}, []
    for url, cache, max_len, why in figures:
        if cache is None and share is None:
            endpoints[url] = {"note": why or f"no {CACHE_INFO}"}
            continue
        if cache is None:
            lines.append(f"note: {url}: no KV cache figures at {metrics_url(url)} ({why or f'no {CACHE_INFO}'}); "
                         "--concurrency is not checked against it")
            endpoints[url] = {"note": why or f"no {CACHE_INFO}"}
            continue
        # vLLM refuses prompt + max_tokens over its context, and without --max-tokens an answer may fill it
        request = min(prompt + max_tokens, max_len or math.inf) if max_tokens else max_len
        if not request:
            lines.append(f"note: {url}: KV cache {cache:,} tokens; without --max-tokens or the server's "
                         "max_model_len the answers' length is unknown, so --concurrency is not checked")
            endpoints[url] = {"cache_tokens": cache, "max_model_len": max_len}
            continue
        fit = fitting_concurrency(cache, request)
        fits.append(fit)
        endpoints[url] = {"cache_tokens": cache, "max_model_len": max_len, "request_tokens": request,
                          "concurrency_fits": fit}
        what = f"(~{prompt:,} prompt + {max_tokens:,} --max-tokens)" if max_tokens else "(max_model_len)"
        if share is None:
            lines.append(f"01b: {url}: KV cache {cache:,} tokens holds {fit:,} requests of {request:,} tokens "
                         f"{what} whole; --concurrency auto follows its live load")
        elif share * request > cache:
            lines.append(f"warning: {url}: {share:,} requests in flight x {request:,} tokens {what} = "
                         f"{share * request:,} tokens > the server's KV cache of {cache:,} tokens: vLLM will "
                         f"preempt and recompute answers; --concurrency {fit * len(figures):,} keeps them resident")
        else:
            lines.append(f"01b: {url}: KV cache {cache:,} tokens holds {fit:,} requests of {request:,} tokens "
                         f"{what}; {share:,} in flight fit")
    record = {"prompt_tokens_estimate": prompt, "endpoints": endpoints}
    if fits:
        record["concurrency_fits"] = min(fits) * len(figures)
    return lines, record


async def check_server_cache(client: ChatClient, prompts: list[Prompt], args, say) -> dict:
    """01b's preflight of the servers' KV caches (vLLM's /metrics, read once before any prompt):
    calls `say(line)` per line of cache_report; returns its record for the manifest."""
    figures = [(ep.url, cache_tokens(text) if text else None, ep.max_model_len, why)
               for ep, text, why in await client.metrics()]
    lines, record = cache_report(figures, None if args.auto else args.concurrency, prompt_tokens_estimate(prompts),
                                 args.max_tokens)
    for line in lines:
        say(line)
    return record
