"""What the pilot's 01b measured, for 00's model of the full run (plan/gen.py): tok/s at the levels
01b ran and the answers' length distribution, written to <work-dir>/pilot/gen_rates.json, where
00_plan finds it (--work-dir, or --measured FILE).

  points   with --concurrency auto: the controller's history in 01b's manifest
           (this_run.concurrency.endpoints.<url>.history: t, level, kv, running, waiting,
           preemptions, tok_s), its windows grouped by the level allowed; each point's `level` is the
           answers the server was running in those windows (the mean of each window's two readings:
           fewer than allowed in the pilot's tail);
           with a fixed level: the generated tokens over the time answers were in flight (each
           record's created - latency_s .. created), at the mean answers in flight
  answers  count, mean, p50, p90, p99, max, resident (gen.length_stats) of the generated ids
"""

from __future__ import annotations

from pathlib import Path

from eagle3_train.common.errors import PipelineError
from eagle3_train.common.manifest import MANIFEST
from eagle3_train.common.store import read_jsonl
from eagle3_train.common.layout import RAW
from eagle3_train.plan import gen as G

GEN_RATES = "gen_rates.json"  # under <work-dir>/pilot


def _epoch(created: str) -> float:
    import datetime as dt

    return dt.datetime.fromisoformat(created).timestamp()


def busy_rate(records: list[dict]) -> dict | None:
    """A fixed level's measured point from 01b's records: generated tokens over the union of the
    spans answers were in flight (a resumed run's pause is not counted), and the mean answers in
    flight over it (the sum of latencies / that time). None without timing fields."""
    spans, tokens = [], 0
    for r in records:
        if r.get("created") is None or r.get("latency_s") is None:
            continue
        end = _epoch(r["created"])
        spans.append((end - float(r["latency_s"]), end, float(r["latency_s"])))
        tokens += len(r.get("token_ids") or ())
    if not spans or not tokens:
        return None
    spans.sort()
    busy, start, stop = 0.0, spans[0][0], spans[0][1]
    for s, e, _ in spans[1:]:
        if s > stop:
            busy, start, stop = busy + stop - start, s, e
        else:
            stop = max(stop, e)
    busy += stop - start
    if busy <= 0:
        return None
    return {"level": round(sum(x[2] for x in spans) / busy, 1), "tok_s": round(tokens / busy, 1),
            "seconds": round(busy, 1), "how": "fixed: generated tokens over the time answers were in flight"}


def history_points(history: list[dict]) -> list[dict]:
    """--concurrency auto's windows grouped by the level allowed: the answers running in a window
    taken as the mean of its two readings (the gauge at its start and end: a pilot's tail drains
    within one), averaged over the level's windows with their tok/s."""
    groups: dict[int, list[tuple[float, float]]] = {}
    for prev, h in zip(history, history[1:]):
        running = ((prev.get("running") or 0) + (h.get("running") or 0)) / 2
        if h.get("tok_s") is not None and h.get("level") and running > 0:
            groups.setdefault(int(h["level"]), []).append((running, float(h["tok_s"])))
    return [{"level": round(sum(r for r, _ in ws) / len(ws), 1), "auto_level": level,
             "tok_s": round(sum(t for _, t in ws) / len(ws), 1), "windows": len(ws),
             "how": "auto: the controller's windows at this level"}
            for level, ws in sorted(groups.items()) if sum(t for _, t in ws) > 0]


def server_flag(args: list[str], name: str) -> str | None:
    """--name=value (or --name value) among a server's extra arguments."""
    for i, a in enumerate(args):
        if a.startswith(f"{name}="):
            return a.split("=", 1)[1]
        if a == name and i + 1 < len(args):
            return args[i + 1]
    return None


def gen_rates(raw_dir: Path, manifest: dict, server_args: list[str] = ()) -> dict:
    """gen_rates.json of a finished 01b output (its manifest and raw_responses.jsonl)."""
    records = list(read_jsonl(Path(raw_dir) / RAW))
    lengths = [len(r.get("token_ids") or ()) for r in records]
    answers = G.length_stats(lengths, f"{Path(raw_dir) / RAW}")
    prompts = [len(r.get("prompt_token_ids") or ()) for r in records]
    this_run = manifest.get("this_run") or {}
    conc = this_run.get("concurrency") or {}
    points, setting = [], conc.get("setting", (manifest.get("config") or {}).get("concurrency"))
    for ep in (conc.get("endpoints") or {}).values():
        points += history_points(ep.get("history") or [])
    if not points:
        fixed = busy_rate(records)
        if fixed is not None:
            points = [fixed | {"concurrency": setting}]
    caches = [e["cache_tokens"] for e in ((this_run.get("server_cache") or {}).get("endpoints") or {}).values()
              if isinstance(e, dict) and e.get("cache_tokens")]
    dcp = server_flag(list(server_args), "--decode-context-parallel-size")
    return {"source": str(raw_dir), "concurrency": setting, "points": points,
            "answers": answers | {"source": "measured by the pilot's 01b"},
            "prompt_tokens": round(sum(prompts) / len(prompts)) if prompts else None,
            "max_tokens": (manifest.get("config") or {}).get("max_tokens"),
            "cache_tokens": min(caches) if caches else None,
            "kv_cache_dtype": server_flag(list(server_args), "--kv-cache-dtype") or "auto",
            "dcp": int(dcp) if dcp else 1}


def read_01b(raw_dir: Path) -> dict:
    import json

    path = Path(raw_dir) / MANIFEST
    if not path.exists():
        raise PipelineError(f"{raw_dir}: no {MANIFEST} (01b did not finish)")
    return json.loads(path.read_text())


def full_run(target: str, rates: dict, samples: int, gpus: int, max_tokens: int | None) -> dict:
    """01b of the full run (`samples` prompts) from the pilot's measured rates, lengths and cache:
    the planner's pure plan() with them in place of its assumptions; its 01b lines and hours."""
    from eagle3_train.plan import planner as P
    from eagle3_train.plan.stage import gen_lines

    answers, prompt = rates["answers"], rates.get("prompt_tokens") or 1
    points = [(p["level"], p["tok_s"]) for p in rates["points"]] or None
    f = P.Flags(samples=samples, tokens_per_sample=prompt + answers["mean"], gpus=gpus, gen_prompt_tokens=prompt,
                gen_max_tokens=max_tokens or answers["max"], weights_gb=P.local_weights_gb(target),
                answers=answers, gen_points=points,
                gen_points_source=G.curve_source(points, "the pilot's 01b") if points else None,
                cache_tokens=rates.get("cache_tokens"), kv_cache_dtype=rates.get("kv_cache_dtype", "auto"),
                dcp=rates.get("dcp", 1))
    gen = P.plan(P.load_shape(target), f)["stages"]["01b"]
    return {"samples": samples, "hours": gen["hours"], "tok_s": round(gen["rate_tok_s"], 1),
            "concurrency": gen["serving"].get("concurrency"), "rate_source": gen["rate_source"],
            "lines": gen_lines(gen, P.asdict(f))}
