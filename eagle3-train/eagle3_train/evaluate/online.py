"""05 online: a real vLLM server per arm -- `eagle3` (the draft, served with its method: eagle3 or
dflash; with --k-sweep once per K), `none` (no speculation), `ngram` (prompt lookup) -- the same
held-out prompts and sampling settings in every arm, at a few concurrency levels; the spec-decode
counters of /metrics are read before and after each level, so AL = 1 + accepted / drafts and the
per-position rates are vLLM's own."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Sequence
from pathlib import Path

from eagle3_train.common.errors import PipelineError
from eagle3_train.common.progress import Progress
from eagle3_train.common.server_wait import log_line, wait_for_servers
from eagle3_train.evaluate.config import ARMS

SPEC_DRAFTS = "vllm:spec_decode_num_drafts_total"
SPEC_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
SPEC_ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
SPEC_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"


def spec_config(arm: str, draft_dir: Path, k: int, ngram: tuple[int, int], method: str = "eagle3") -> dict | None:
    """vLLM's --speculative-config for an arm; the draft's with its `method` (eagle3 or dflash)
    always written: without it vLLM guesses the method from the directory name."""
    if arm == "none":
        return None
    if arm == "eagle3":
        return {"method": method, "model": str(Path(draft_dir).resolve()), "num_speculative_tokens": k}
    if arm == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k,
                "prompt_lookup_min": ngram[0], "prompt_lookup_max": ngram[1]}
    raise PipelineError(f"unknown arm {arm!r}; choose from {', '.join(ARMS)}")


_LABEL = re.compile(r'position="(\d+)"')


def spec_counters(metrics: dict[str, float]) -> dict:
    """vLLM's spec-decode counters, summed over engines: drafts, draft_tokens, accepted, per_pos."""
    out = {"drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0, "per_pos": {}}
    names = {SPEC_DRAFTS: "drafts", SPEC_DRAFT_TOKENS: "draft_tokens", SPEC_ACCEPTED: "accepted"}
    for key, val in metrics.items():
        name = key.split("{", 1)[0]
        if name in names:
            out[names[name]] += val
        elif name == SPEC_PER_POS:
            m = _LABEL.search(key)
            if m:
                pos = int(m.group(1))
                out["per_pos"][pos] = out["per_pos"].get(pos, 0.0) + val
    return out


def spec_delta(before: dict, after: dict) -> dict:
    """Counters of one run (after - before) and what vLLM would show for it."""
    d = {k: int(round(after[k] - before[k])) for k in ("drafts", "draft_tokens", "accepted")}
    positions = sorted(set(before["per_pos"]) | set(after["per_pos"]))
    per_pos = [int(round(after["per_pos"].get(p, 0) - before["per_pos"].get(p, 0))) for p in positions]
    drafts = d["drafts"]
    return {**d, "per_pos": per_pos,
            "acceptance_length": 1.0 + d["accepted"] / drafts if drafts else None,
            "per_position_rate": [a / drafts for a in per_pos] if drafts else [],
            "draft_token_acceptance": d["accepted"] / d["draft_tokens"] if d["draft_tokens"] else None}


async def _served_model(base_url: str, timeout: float) -> str:
    from eagle3_train.common.client import make_openai_client

    client = make_openai_client(base_url, api_key="EMPTY", concurrency=1)
    try:
        async with asyncio.timeout(min(timeout, 60)):
            models = await client.models.list()
    except Exception as e:  # unreachable / not an OpenAI server: one line
        raise PipelineError(f"cannot list the models of {base_url}: {type(e).__name__}: {e}") from None
    finally:
        await client.close()
    if not models.data:
        raise PipelineError(f"{base_url} serves no model")
    return models.data[0].id


async def _run_prompts(base_url: str, model: str, prompts: list, concurrency: int,
                       sampling: dict, timeout: float, prog: Progress | None) -> dict:
    """All prompts with `concurrency` in flight, through 01b's client (openai SDK, retries on
    transient errors); output tokens = the generated token ids vLLM returns."""
    from eagle3_train.common.client import ChatClient

    sem = asyncio.Semaphore(concurrency)
    tokens, errors, latencies = [0], [], []
    extra = dict(sampling.get("extra_body") or {})
    params = {k: v for k, v in sampling.items() if k != "extra_body"}

    async with ChatClient([base_url], model, timeout=timeout, max_retries=2, concurrency=concurrency) as client:
        async def one(p):
            async with sem:
                res = await client.complete(client.body(p.messages, params, extra_body=extra))
            if not res.ok:
                errors.append(f"{p.id}: {res.error.get('error_type')}: {res.error.get('message')}")
                if prog:
                    prog.update(1, errors=1)
                return
            latencies.append(res.latency_s)
            n = len(res.answer["token_ids"])
            tokens[0] += n
            if prog:
                prog.update(1, tokens=n)

        t0 = time.perf_counter()
        await asyncio.gather(*(one(p) for p in prompts))
        wall = time.perf_counter() - t0
    if len(errors) == len(prompts):
        raise PipelineError(f"every request to {base_url} failed; first: {errors[0]}")
    lat = sorted(latencies)
    return {"concurrency": concurrency, "requests": len(prompts) - len(errors), "errors": len(errors),
            "error_samples": errors[:3], "completion_tokens": tokens[0], "wall_s": round(wall, 3),
            "output_tok_s": tokens[0] / wall if wall > 0 else 0.0,
            "req_s": (len(prompts) - len(errors)) / wall if wall > 0 else 0.0,
            "latency_p50_s": lat[len(lat) // 2] if lat else None}


def bench_server(base_url: str, prompts: list, levels: Sequence[int], sampling: dict, *,
                 arm: str, timeout: float = 600, warmup: int = 2, log_path: Path | None = None,
                 every_s: float = 10.0, wait_s: float = 0.0) -> dict:
    """Run the prompts at each concurrency level against one server, reading the spec-decode
    counters around each level. Warm-up requests (not counted) go first. `wait_s`: how long a
    server given by URL may still be loading (common/server_wait.py)."""
    from eagle3_train.common.server_metrics import metrics_url
    from eagle3_train.common.vllm_server import scrape_metrics

    murl = metrics_url(base_url)

    def counters():
        try:
            return spec_counters(scrape_metrics(murl))
        except OSError as e:
            raise PipelineError(f"cannot read {murl}: {e}") from None

    if wait_s:
        asyncio.run(wait_for_servers([base_url], wait_s, say=log_line(f"05 {arm}", log_path)))
    model = asyncio.run(_served_model(base_url, timeout))
    if warmup:
        asyncio.run(_run_prompts(base_url, model, prompts[:warmup], warmup, sampling, timeout, None))
    out = []
    for c in levels:
        before = counters()
        with Progress(f"05 {arm} c={c}", len(prompts), log_path=log_path, every_s=every_s, unit="req") as prog:
            res = asyncio.run(_run_prompts(base_url, model, prompts, c, sampling, timeout, prog))
        res["spec"] = spec_delta(before, counters())
        out.append(res)
    total = {k: sum(r["spec"][k] for r in out) for k in ("drafts", "draft_tokens", "accepted")}
    per_pos = [sum(v) for v in zip(*(r["spec"]["per_pos"] for r in out))] if out else []
    zero = {"drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0, "per_pos": {}}
    spec = spec_delta(zero, {**{k: float(v) for k, v in total.items()},
                             "per_pos": {i: float(v) for i, v in enumerate(per_pos)}})
    return {"arm": arm, "base_url": base_url, "model": model, "levels": out, "spec": spec}


def run_arm(arm: str, *, target: Path, draft_dir: Path, k: int, ngram: tuple[int, int],
            prompts: list, levels: Sequence[int], sampling: dict, url: str | None,
            server_kwargs: dict, log_dir: Path, timeout: float, every_s: float = 10.0,
            method: str = "eagle3", name: str | None = None, wait_s: float = 0.0) -> dict:
    """One arm: against `url` if given (waiting up to `wait_s` while it loads), else a server of
    our own started and stopped here (its log vllm-<name>.log, name default: the arm)."""
    from eagle3_train.common.vllm_server import VllmServer, server_command

    spec = spec_config(arm, draft_dir, k, ngram, method)
    name = name or arm
    log_path = log_dir / "progress.log"
    if url:
        res = bench_server(url, prompts, levels, sampling, arm=name, timeout=timeout, log_path=log_path,
                           every_s=every_s, wait_s=wait_s)
        res["server"] = "connected"
    else:
        srv = VllmServer(target, log_path=log_dir / f"vllm-{name}.log", speculative_config=spec,
                         **server_kwargs)
        print(f"[05] starting vLLM for arm {name}: {srv.command_line()}", flush=True)
        with srv:
            res = bench_server(srv.base_url, prompts, levels, sampling, arm=name, timeout=timeout,
                               log_path=log_path, every_s=every_s)
        res["server"] = "started"
        res["command"] = srv.cmd
    drafts = res["spec"]["drafts"]
    if spec is None and drafts:
        raise PipelineError(f"arm none: the server at {res['base_url']} speculates ({drafts} drafts); "
                            "point --url none=... at a server without --speculative-config")
    if spec is not None and not drafts:
        cmd = " ".join(server_command(str(target), 8000, speculative_config=spec, cpu=False))
        raise PipelineError(f"arm {arm}: vLLM at {res['base_url']} made no drafts (spec-decode "
                            f"counters did not move); start it as: {cmd}")
    res["speculative_config"] = spec
    return res
