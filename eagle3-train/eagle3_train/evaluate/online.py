"""05 online: a real vLLM server per arm -- `eagle3` (the draft, served with its method: eagle3 or
dflash; with --k-sweep once per K), `none` (no speculation), `ngram` (prompt lookup) -- the same
held-out prompts and sampling settings in every arm, at a few concurrency levels; the spec-decode
counters of /metrics are read before and after each level, so AL = 1 + accepted / drafts and the
per-position rates are vLLM's own. Acceptance along the answer (`by_position`) comes from vLLM's
per-request record of its verify steps (`metrics.speculative_decoding` of each answer, sent when
the server runs with --per-request-spec-decode-metrics detailed: 05 starts its servers so)."""

from __future__ import annotations

import asyncio
import json
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from eagle3_train.common import positions
from eagle3_train.common.client import ChatClient, parse_completion
from eagle3_train.common.errors import PipelineError
from eagle3_train.common.progress import Progress
from eagle3_train.common.prompts import sample_seed
from eagle3_train.common.server_wait import log_line, wait_for_servers
from eagle3_train.evaluate.config import ARMS, RECORD_FLAG

SPEC_DRAFTS = "vllm:spec_decode_num_drafts_total"
SPEC_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
SPEC_ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
SPEC_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
# vLLM's per-request record of every verify step; `detailed` adds the ordered per-step counts.
RECORD_ARGS = [RECORD_FLAG, "detailed"]


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


def spec_record(body: dict) -> dict | None:
    """An answer's `metrics.speculative_decoding` when it holds the ordered per-step counts (the
    `detailed` level; a request that never drafted has none to hold), else None."""
    rec = (body.get("metrics") or {}).get("speculative_decoding") if isinstance(body, dict) else None
    if not isinstance(rec, dict):
        return None
    if rec.get("per_step_accepted") is None and rec.get("num_spec_steps"):
        return None  # the `summary` level: counts without their order
    return rec


def record_counts(rec: dict, prompt_tokens: int, completion_tokens: int, k: int,
                  edges=positions.EDGES) -> tuple[dict, bool]:
    """One answer's counts by position from its record, and whether the record is exact: the prefill
    makes one token and each verify step accepted + 1, so the steps must cover every completion
    token, the last step overshooting by at most K (tokens past a stop or max_tokens are dropped).
    A server that decoded some steps without drafting covers fewer: its positions drift."""
    acc, drafted = rec.get("per_step_accepted") or [], rec.get("per_step_drafted") or []
    k = int(rec.get("num_spec_tokens") or k)
    counts = positions.from_vllm_steps(prompt_tokens, acc, drafted, k, edges)
    covered = 1 + sum(int(a) + 1 for a in acc)
    return counts, completion_tokens <= covered <= completion_tokens + k


class PositionTally:
    """The answers' records of one level (or arm) summed: counts by position, plus the records'
    own drafts / draft tokens / accepted totals to hold against /metrics."""

    def __init__(self, k: int, edges=positions.EDGES):
        self.k, self.edges = k, tuple(edges)
        self.parts: list[dict] = []
        self.requests = self.no_record = self.positions_inexact = 0
        self.drafts = self.draft_tokens = self.accepted = 0

    def add(self, answer: dict) -> None:
        rec = answer.get("spec_record")
        if rec is None:
            self.no_record += 1
            return
        usage = answer.get("usage") or {}
        prompt = usage.get("prompt_tokens", len(answer.get("prompt_token_ids") or []))
        done = usage.get("completion_tokens", len(answer.get("token_ids") or []))
        counts, exact = record_counts(rec, int(prompt), int(done), self.k, self.edges)
        self.parts.append(counts)
        self.requests += 1
        self.positions_inexact += not exact
        self.drafts += int(rec.get("num_spec_steps") or 0)
        self.draft_tokens += int(rec.get("num_draft_tokens") or 0)
        self.accepted += int(rec.get("num_accepted_draft_tokens") or 0)

    def result(self, metrics: dict | None = None) -> dict | None:
        """`by_position` ({"edges", "counts", "rows"} as offline, plus how many answers had a record,
        had none, or were inexact); None when no answer had one. `metrics`: /metrics' counts of the
        same requests -> `metrics_match`, the records' totals equal to them."""
        if not self.requests:
            return None
        counts = positions.merge(self.parts) if self.parts else positions.empty(self.k, self.edges)
        out = {**positions.block(counts), "requests": self.requests, "no_record": self.no_record,
               "positions_inexact": self.positions_inexact,
               "records": {"drafts": self.drafts, "draft_tokens": self.draft_tokens, "accepted": self.accepted}}
        if metrics is not None:
            out["metrics_match"] = all(out["records"][n] == metrics[n] for n in ("drafts", "draft_tokens", "accepted"))
        return out


def merge_by_position(parts: Sequence[dict | None]) -> dict | None:
    """The levels' `by_position` summed into the arm's (None when no level had records)."""
    parts = [p for p in parts if p]
    if not parts:
        return None
    counts = positions.merge([p["counts"] for p in parts])
    out = {**positions.block(counts),
           **{n: sum(p[n] for p in parts) for n in ("requests", "no_record", "positions_inexact")},
           "records": {n: sum(p["records"][n] for p in parts) for n in ("drafts", "draft_tokens", "accepted")}}
    if all("metrics_match" in p for p in parts):
        out["metrics_match"] = all(p["metrics_match"] for p in parts)
    return out


class RecordingClient(ChatClient):
    """01b's client, keeping each answer's spec-decode record (`spec_record`) too."""

    def parse(self, content: bytes) -> dict:
        answer = parse_completion(content, self.require_token_ids)
        answer["spec_record"] = spec_record(json.loads(content))
        return answer


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
                       sampling: dict, timeout: float, prog: Progress | None,
                       tally: PositionTally | None = None) -> dict:
    """All prompts with `concurrency` in flight, through 01b's client (openai SDK, retries on
    transient errors); output tokens = the generated token ids vLLM returns; each answer's
    spec-decode record into `tally`."""
    sem = asyncio.Semaphore(concurrency)
    tokens, errors, latencies = [0], [], []
    extra = dict(sampling.get("extra_body") or {})
    params = {k: v for k, v in sampling.items() if k != "extra_body"}

    async with RecordingClient([base_url], model, timeout=timeout, max_retries=2, concurrency=concurrency) as client:
        async def one(p):
            own = {**params, "seed": sample_seed(params.get("seed"), p.id)}  # None stays unseeded: body drops it
            async with sem:
                res = await client.complete(client.body(p.messages, own, extra_body=extra))
            if not res.ok:
                errors.append(f"{p.id}: {res.error.get('error_type')}: {res.error.get('message')}")
                if prog:
                    prog.update(1, errors=1)
                return
            latencies.append(res.latency_s)
            if tally is not None:
                tally.add(res.answer)
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
                 every_s: float = 10.0, wait_s: float = 0.0, k: int = 1,
                 edges: Sequence[int] = positions.EDGES) -> dict:
    """Run the prompts at each concurrency level against one server, reading the spec-decode
    counters around each level and each answer's record of its verify steps (`by_position`, at
    `edges`, per level and for the arm). Warm-up requests (not counted) go first. `wait_s`: how long
    a server given by URL may still be loading (common/server_wait.py)."""
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
        tally = PositionTally(k, edges)
        with Progress(f"05 {arm} c={c}", len(prompts), log_path=log_path, every_s=every_s, unit="req") as prog:
            res = asyncio.run(_run_prompts(base_url, model, prompts, c, sampling, timeout, prog, tally))
        res["spec"] = spec_delta(before, counters())
        res["by_position"] = tally.result(res["spec"])
        out.append(res)
    total = {k: sum(r["spec"][k] for r in out) for k in ("drafts", "draft_tokens", "accepted")}
    per_pos = [sum(v) for v in zip(*(r["spec"]["per_pos"] for r in out))] if out else []
    zero = {"drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0, "per_pos": {}}
    spec = spec_delta(zero, {**{k: float(v) for k, v in total.items()},
                             "per_pos": {i: float(v) for i, v in enumerate(per_pos)}})
    return {"arm": arm, "base_url": base_url, "model": model, "levels": out, "spec": spec,
            "by_position": merge_by_position([r["by_position"] for r in out])}


def arm_server(target: Path, spec: dict | None, log_path: Path, server_kwargs: dict):
    """The vLLM server 05 starts for an arm (not yet started): a speculating one also sends each
    answer's record of its verify steps (vLLM refuses the flag without speculation)."""
    from eagle3_train.common.vllm_server import VllmServer

    if spec is not None:
        server_kwargs = {**server_kwargs, "extra_args": [*(server_kwargs.get("extra_args") or []), *RECORD_ARGS]}
    return VllmServer(target, log_path=log_path, speculative_config=spec, **server_kwargs)


def run_arm(arm: str, *, target: Path, draft_dir: Path, k: int, ngram: tuple[int, int],
            prompts: list, levels: Sequence[int], sampling: dict, url: str | None,
            server_kwargs: dict, log_dir: Path, timeout: float, every_s: float = 10.0,
            method: str = "eagle3", name: str | None = None, wait_s: float = 0.0,
            edges: Sequence[int] = positions.EDGES) -> dict:
    """One arm: against `url` if given (waiting up to `wait_s` while it loads), else a server of
    our own started and stopped here (its log vllm-<name>.log, name default: the arm), with the
    per-request record when it speculates (acceptance by position, bucketed at `edges`)."""
    from eagle3_train.common.vllm_server import server_command

    spec = spec_config(arm, draft_dir, k, ngram, method)
    name = name or arm
    log_path = log_dir / "progress.log"
    if url:
        res = bench_server(url, prompts, levels, sampling, arm=name, timeout=timeout, log_path=log_path,
                           every_s=every_s, wait_s=wait_s, k=k, edges=edges)
        res["server"] = "connected"
    else:
        srv = arm_server(target, spec, log_dir / f"vllm-{name}.log", server_kwargs)
        print(f"[05] starting vLLM for arm {name}: {srv.command_line()}", flush=True)
        with srv:
            res = bench_server(srv.base_url, prompts, levels, sampling, arm=name, timeout=timeout,
                               log_path=log_path, every_s=every_s, k=k, edges=edges)
        res["server"] = "started"
        res["command"] = srv.cmd
    drafts = res["spec"]["drafts"]
    if spec is None and drafts:
        raise PipelineError(f"arm none: the server at {res['base_url']} speculates ({drafts} drafts); "
                            "point --url none=... at a server without --speculative-config")
    if spec is not None and not drafts:
        cmd = " ".join(server_command(str(target), 8000, speculative_config=spec, extra_args=RECORD_ARGS, cpu=False))
        raise PipelineError(f"arm {arm}: vLLM at {res['base_url']} made no drafts (spec-decode "
                            f"counters did not move); start it as: {cmd}")
    if spec is not None and res["by_position"] is None:
        print(f"warning: arm {name}: the server at {res['base_url']} sends no per-request spec-decode record, so "
              f"there is no acceptance by position (the /metrics figures are reported); start it with "
              f"{' '.join(RECORD_ARGS)}", file=sys.stderr, flush=True)
    res["speculative_config"] = spec
    return res
