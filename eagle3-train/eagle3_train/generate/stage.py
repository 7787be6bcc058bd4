"""01b: prompts -> the target's own answers, one JSONL record per sample, losing nothing.

Output directory:
  raw_responses.jsonl  one record per answered id (see DESIGN.md), appended as each completes
  errors.jsonl         ids with no answer yet and why (after a run: each failed id once, and no
                       id that is also in raw_responses.jsonl)
  run.json             what defines the data (input, model, sampling): a resume must match it (rerun.py)
  progress.log         a plain line every --progress-every seconds, for `tail -f`
  manifest.json        written last; only then is the output complete

Resume is the default: work = requested ids - ids in raw_responses.jsonl, so ids that only
failed are retried, and no id is ever written twice. Ctrl-C / SIGTERM cancel the requests in
flight and close the files between two records; kill -9 leaves at most a torn last line, which
the next run cuts off.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as _dt
import json
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from eagle3_train.common import rerun
from eagle3_train.common.client import ChatClient
from eagle3_train.common.config import GENERATE
from eagle3_train.common.errors import PipelineError
from eagle3_train.common.manifest import MANIFEST, describe_file, write_manifest
from eagle3_train.common.progress import Progress
from eagle3_train.common.prompts import Prompt, load_prompts, parse_shard, sample_seed
from eagle3_train.common.server_metrics import gauges
from eagle3_train.common.server_wait import wait_for_servers
from eagle3_train.common.store import DirLock, JsonlWriter, atomic_write_text, clean_temp_files, pending_ids, read_jsonl
from eagle3_train.generate.concurrency import Pool, Steer, make_pools
from eagle3_train.generate.concurrency import record as concurrency_record
from eagle3_train.generate.config import ERRORS, PROGRESS_LOG, RAW
from eagle3_train.generate.server_cache import check_server_cache
from eagle3_train.common.text_answers import TEXT_WARNING, text_answer, text_warning

STAGE = GENERATE


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


# ----------------------------------------------------------------------------- planning (pure)

@dataclass
class Plan:
    pending: list[str]    # ids to request now, in input order
    done: int             # requested ids already answered
    retrying: int         # pending ids that failed in an earlier run


def plan_work(requested: list[str], committed, failed) -> Plan:
    """Work = requested - committed (store.pending_ids); failures are simply not committed."""
    committed, failed = set(committed), set(failed)
    pending = pending_ids(requested, committed)
    return Plan(pending, sum(1 for i in set(requested) if i in committed),
                sum(1 for i in pending if i in failed))


def sampling_for(args, pid: str) -> dict:
    return {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p,
            "seed": sample_seed(args.seed, pid)}


def source_identity(cfg, input_desc: dict) -> dict:
    """The prompts as resolved (the file's path or the dataset's name; the split of a dataset only),
    so a rerun naming the same source another way resumes."""
    src = input_desc.get("path") or input_desc.get("name") or cfg.input
    return {"input": src, "split": cfg.split if input_desc.get("kind") == "dataset" else None}


def compact_errors(path: Path, committed: set[str]) -> dict[str, dict]:
    """Keep one line (the latest) per id that still has no answer; atomic rewrite."""
    latest: dict[str, dict] = {}
    for rec in read_jsonl(path):
        if "id" in rec and rec["id"] not in committed:
            latest[rec["id"]] = rec
    if path.exists():
        atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False, separators=(",", ":")) + "\n"
                                        for r in latest.values()))
    return latest


def committed_ids(path: Path) -> list[str]:
    ids = [rec["id"] for rec in read_jsonl(path) if "id" in rec]
    dup = len(ids) - len(set(ids))
    if dup:  # cannot come from this stage; say so instead of training on doubles
        raise PipelineError(f"{path} has {dup} duplicate ids: it was edited or concatenated by hand")
    return ids


def no_retry_helps(errors: list[dict]) -> str | None:
    """Why requests failed when no retry can fix it, in words (e.g. "rejected as a bad request (400:
    ...): fix the settings or the prompts"); None if any of `errors` (errors.jsonl records) is worth
    retrying: a timeout, a connection error, 408/409/429, 5xx, a garbled body (client.classify)."""
    if not errors or any(e.get("retryable", True) for e in errors):
        return None
    kind = Counter(e.get("error_type") for e in errors).most_common(1)[0][0]
    e = next(e for e in errors if e.get("error_type") == kind)
    status, msg = e.get("status"), _short(e.get("message"))
    if status in (400, 413, 422):
        return f"rejected as a bad request ({status}: {msg}): fix the settings or the prompts"
    if status in (401, 403):
        return f"refused by the server ({status}: {msg}): check --api-key"
    if status == 404:
        return f"answered 404 ({msg}): check --model and --base-url"
    if isinstance(status, int) and status != 200:
        return f"rejected with HTTP {status} ({msg})"
    return f"failed with {kind} ({msg})"


def _short(text, limit: int = 200) -> str:
    text = " ".join(str(text or "").split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ----------------------------------------------------------------------------- the run

class _Abort(Exception):
    pass


@dataclass
class RunResult:
    requested: int
    answered: int
    failed: int
    interrupted: str | None
    new_answers: int
    new_errors: int
    tokens: int
    text_derived: int = 0  # answers in the file whose ids were re-wrapped from text
    unretryable: str | None = None  # why the ids still failed, when no retry can fix it (no_retry_helps)
    states_reasked: int | None = None  # --capture-hidden-states: requests sent again for an unusable states file
    fmt: object = None  # the ChatFormat loaded before the run (--tokenize): 01c's step reuses it, not a second load


def _say(progress: Progress, line: str) -> None:
    """A line on the terminal (above the bar) and in progress.log (`tail -f` over SSH)."""
    progress.bar.write(line)
    if progress.log_path is not None:
        with open(progress.log_path, "a") as f:
            f.write(f"{_now()} {STAGE} {line}\n")


async def _generate(prompts: list[Prompt], args, out_dir: Path, progress: Progress, text_fmt=None, cap=None) -> dict:
    """`text_fmt` (a ChatFormat) set: answers without token ids are re-wrapped from their text.
    `cap` (a capture.Capture): each answer is committed with its hidden states (capture.py)."""
    client_class = ChatClient if cap is None else cap.client_class
    client = client_class(args.base_url, args.model, timeout=args.timeout, max_retries=args.max_retries,
                        backoff_base=args.backoff_base, backoff_max=args.backoff_max,
                        connect_timeout=args.connect_timeout, api_key=args.api_key,
                        concurrency=args.most_in_flight, transport=args.transport,
                        require_token_ids=text_fmt is None)
    loop = asyncio.get_running_loop()
    stats = {"answered": 0, "failed": 0, "tokens": 0, "interrupted": None, "finish": Counter(),
             "error_types": Counter(), "text_derived": 0}
    written: set[str] = set()

    def say(line: str) -> None:
        _say(progress, line)

    streak: list[dict] = []  # the errors of the failures in a row so far
    it = iter(prompts)
    raw = JsonlWriter(out_dir / RAW, fsync=False)
    err = JsonlWriter(out_dir / ERRORS, fsync=False)

    taken = [0]  # prompts taken by the workers so far

    async def worker(pool: Pool):
        # A pool above its level loses workers here, between two requests: none is ever cancelled.
        try:
            while pool.keep():
                p = next(it, None)
                if p is None:
                    break
                taken[0] += 1
                await answer(p, pool)
            else:
                return  # keep() counted this worker out
        except BaseException:
            pool.workers -= 1
            raise
        pool.workers -= 1

    async def answer(p: Prompt, pool: Pool):
        sampling = sampling_for(args, p.id)
        body = client.body(p.messages, sampling, chat_template_kwargs=args.chat_template_kwargs,
                           extra_body=args.extra_body if cap is None else cap.extra_body(args.extra_body))
        out = await client.complete(body, pool.endpoint)
        states = None
        if cap is not None:  # read before the commit below; a lost file asks again
            out, states = await cap.collect(p, out, lambda body=body: client.complete(body))
        # From here to the next await nothing can interrupt: a record is written whole or not.
        if p.id in written:
            return
        written.add(p.id)
        if out.ok:
            a = out.answer
            if a["token_ids"] is None:  # only with --allow-text-fallback (see text_import)
                a = text_answer(text_fmt, p.messages, a)
                stats["text_derived"] += 1
            rec = {"id": p.id, "messages": p.messages, **a, "sampling": sampling,
                   "endpoint": out.endpoint, "latency_s": out.latency_s, "attempts": out.attempts,
                   "created": _now()}
            cap.add(rec, states) if cap is not None else raw.write(rec)
            stats["answered"] += 1
            stats["tokens"] += len(a["token_ids"])
            stats["finish"][a["finish_reason"]] += 1
            streak.clear()
            progress.update(1, tokens=len(a["token_ids"]))
        else:
            e = out.error
            err.write({"id": p.id, **e, "created": _now()})
            stats["failed"] += 1
            stats["error_types"][e["error_type"]] += 1
            streak.append(e)
            progress.update(1, errors=1, last_error=e["error_type"])
            if args.abort_after and len(streak) >= args.abort_after:
                cause = no_retry_helps(streak)
                if cause:
                    raise _Abort(f"{len(streak)} requests in a row were {cause}; a rerun would fail the "
                                 "same way (the answers so far are kept)")
                raise _Abort(f"{len(streak)} requests in a row failed after retries (last: "
                             f"{e['error_type']}: {e['message']}); the server looks down or "
                             "misconfigured; fix it and rerun the same command to resume")

    async def syncer():
        while True:
            await asyncio.sleep(2.0)
            raw.sync()
            err.sync()

    main_task = asyncio.current_task()
    tasks: list[asyncio.Task] = []
    control: list[asyncio.Task] = []  # the controllers' loop (--concurrency auto)

    def on_signal(name):
        if stats["interrupted"] is None:
            stats["interrupted"] = name
            busy = sum(1 for t in tasks if not t.done())
            progress.bar.write(f"{name}: stopping; {busy} requests in flight are abandoned "
                               "(they stay pending; rerun the same command to resume)")
        for t in (*tasks, *control):
            t.cancel()
        if not tasks:
            main_task.cancel()

    sigs = (signal.SIGINT, signal.SIGTERM)
    for s in sigs:
        loop.add_signal_handler(s, on_signal, s.name)

    def fill(pool: Pool) -> None:
        """Start workers up to the pool's level (no more than the prompts nobody has taken)."""
        for _ in range(min(pool.level - pool.workers, len(prompts) - taken[0])):
            pool.workers += 1
            tasks.append(asyncio.create_task(worker(pool)))
        started.set()

    async def steer_loop(steers: list[Steer]):
        while True:
            await asyncio.sleep(args.concurrency_every)
            read = await client.metrics([st.pool.endpoint for st in steers],
                                        timeout=max(5.0, 3 * args.concurrency_every))
            now = time.monotonic()
            for st, (_, text, _) in zip(steers, read):
                g = gauges(text) if text else None
                if g is not None:  # a missed reading holds the level
                    st.observe(g, now)
                    fill(st.pool)
            progress.extra["level"] = ", ".join(st.line() for st in steers)

    sync_task = asyncio.create_task(syncer())
    started = asyncio.Event()
    abort = None
    steers: list[Steer] = []
    fixed: dict = {}
    try:
        async with client:
            if not args.no_preflight:
                for w in await client.preflight():
                    progress.bar.write(f"warning: {w}")
                stats["server_cache"] = await check_server_cache(client, prompts, args, say)
            pools, steers, fixed = await make_pools(client, args, say)
            for pool in pools:
                fill(pool)
            if steers:
                control.append(asyncio.create_task(steer_loop(steers)))
            # Until every worker has left or one failed; workers started meanwhile wake the wait up.
            while True:
                failed = [t for t in tasks if t.done() and not t.cancelled() and t.exception() is not None]
                tasks[:] = [t for t in tasks if not t.done() or t in failed]
                live = [t for t in tasks if not t.done()]
                if failed or not live:
                    break
                started.clear()
                wake = asyncio.create_task(started.wait())
                await asyncio.wait([*live, wake], return_when=asyncio.FIRST_COMPLETED)
                wake.cancel()
            for t in control:
                t.cancel()
            abort = next((t.exception() for t in failed if isinstance(t.exception(), _Abort)), None)
            if failed:  # an abort, a full disk, a bug: stop the other workers too
                for t in tasks:
                    t.cancel()
            await asyncio.gather(*tasks, *control, return_exceptions=True)
            for t in tasks:
                if not t.cancelled() and t.exception() is not None and not isinstance(t.exception(), _Abort):
                    raise t.exception()
    except asyncio.CancelledError:
        if stats["interrupted"] is None:
            raise
    finally:
        sync_task.cancel()
        for t in control:
            t.cancel()
        for s in sigs:
            loop.remove_signal_handler(s)
        raw.close()
        err.close()
    if abort is not None:
        raise PipelineError(str(abort))
    stats["retries"] = client.retries
    stats["retry_causes"] = client.retry_causes
    if client.retries:  # each one also waited its backoff: the why belongs where the user reads
        say(f"01b: {client.retries} attempts were retried this run: " + "; ".join(
            f"{kind} x{c['count']} (first: {c['first']})" for kind, c in client.retry_causes.items()))
    stats["concurrency"] = concurrency_record(args, steers, fixed)
    stats["endpoints"] = {e.url: {"ok": e.ok, "failed_attempts": e.failed} for e in client.endpoints}
    return stats


def run_generation(args) -> RunResult:
    """The whole stage for a GenerateConfig (see 01b_generate_synthetic.py)."""
    out_dir = args.output_dir
    shard = parse_shard(args.shard)
    fmt = None
    if args.allow_text_fallback or args.tokenize:  # the tokenizer and its ids: before anything is written or asked
        from eagle3_train.common.tokenization import chat_format_from_args

        fmt = chat_format_from_args(args, default_tokenizer=args.model)
    with DirLock(out_dir, STAGE):
        clean_temp_files(out_dir)
        ps = load_prompts(args.input, split=args.split, config=args.dataset_config, limit=args.limit,
                          shard=shard, id_key=args.id_field, skip_invalid=args.skip_invalid)
        cap = None
        if args.capture_hidden_states:  # target, layers, tokenizer checked; nothing written yet
            from eagle3_train.generate.capture import Capture

            cap = Capture(args, out_dir, fmt=fmt)
        rerun.prepare(args, {**source_identity(args, ps.source), **(cap.identity() if cap is not None else {})})
        text_fmt = fmt if args.allow_text_fallback else None
        raw_path, err_path = out_dir / RAW, out_dir / ERRORS
        JsonlWriter(raw_path).close()  # repairs a torn tail left by kill -9 before we read it
        if cap is not None:  # answers and states made to agree again after a kill (capture.py)
            cap.open(raw_path, ps.ids)
        committed = set(committed_ids(raw_path))
        failed = compact_errors(err_path, committed)
        plan = plan_work(ps.ids, committed, failed)
        by_id = {p.id: p for p in ps.prompts}
        todo = [by_id[i] for i in plan.pending]
        print(f"01b: {len(ps.ids)} prompts requested, {plan.done} already answered, {len(todo)} to do"
              + (f" ({plan.retrying} failed before, retrying)" if plan.retrying else ""))
        stats = {"answered": 0, "failed": 0, "tokens": 0, "interrupted": None, "finish": Counter(),
                 "error_types": Counter(), "retries": 0, "endpoints": {}}
        if todo:
            (out_dir / MANIFEST).unlink(missing_ok=True)  # in progress again: not complete
            progress = Progress(STAGE, len(ps.ids), initial=plan.done, log_path=out_dir / PROGRESS_LOG,
                                every_s=args.progress_every, unit="req")
            note = "failed"
            try:
                if args.base_url:  # a server given by URL may still be loading (a launched one has waited)
                    asyncio.run(wait_for_servers(args.base_url, args.wait_for_server, api_key=args.api_key,
                                                 say=lambda line: _say(progress, line)))
                with cap.serving(out_dir / "vllm-server.log") if cap is not None else contextlib.nullcontext():
                    stats = asyncio.run(_generate(todo, args, out_dir, progress, text_fmt, cap))
                note = f"stopped by {stats['interrupted']}" if stats["interrupted"] else "finished"
            except KeyboardInterrupt:  # Ctrl-C before _generate took the signals over (the wait)
                note = "stopped by SIGINT"
                raise
            finally:
                if cap is not None:
                    cap.close()  # the answers still buffered are committed with their states
                progress.close(note)
        elif cap is not None:
            cap.close()
        committed = set(committed_ids(raw_path))
        failed = compact_errors(err_path, committed)
        requested = set(ps.ids)
        answered = len(requested & committed)
        still_failed = [failed[i] for i in requested if i in failed]
        text_derived = None
        # No answer at all is not a data set: the directory stays incomplete (run() says why).
        if stats["interrupted"] is None and answered:
            if cap is not None:
                cap.finalize(raw_path)
            text_derived = _write_manifest(out_dir, args, ps, answered, len(still_failed), stats)
        return RunResult(len(ps.ids), answered, len(still_failed), stats["interrupted"], stats["answered"],
                         stats["failed"], stats["tokens"], text_derived or 0, no_retry_helps(still_failed),
                         cap.stats["states_reasked"] if cap is not None else None, fmt)


def run(cfg) -> int:
    """01b end to end: generate, then (with --tokenize) tokenize; returns the exit code (0 all
    answered, 1 some ids still failed, 130/143 stopped by a signal). No answer at all leaves the
    output incomplete: exit 1, or a PipelineError (exit 2) when no retry could fix the cause."""
    res = run_generation(cfg)
    if res.interrupted:
        print(f"01b stopped by {res.interrupted}: {res.answered}/{res.requested} answered so far; "
              "rerun the same command to resume", file=sys.stderr)
        return 143 if res.interrupted == "SIGTERM" else 130
    print(f"01b: {res.answered}/{res.requested} answered ({res.new_answers} this run, "
          f"{res.tokens} tokens), {res.failed} failed"
          + (f", {res.states_reasked} asked again for a missing or unusable hidden-states file"
             if res.states_reasked is not None else "") + f" -> {cfg.output_dir / RAW}")
    if not res.answered:  # nothing to tokenize; the output was not marked complete
        if res.unretryable:
            raise PipelineError(f"every request was {res.unretryable}; a rerun would fail the same way "
                                f"(no answers, so {cfg.output_dir} is not complete; each id's reason is in "
                                f"{ERRORS})")
        print(f"01b: no request was answered ({res.failed} failed after retries; reasons in {ERRORS}), so "
              f"{cfg.output_dir} is not complete; rerun the same command to retry them", file=sys.stderr)
        return 1
    if res.text_derived:
        print(text_warning(res.text_derived, res.answered), file=sys.stderr)
    if cfg.tokenize:
        from eagle3_train.common.tokenization import chat_format_from_args
        from eagle3_train.tokenize.dataset import build_training_set

        fmt = res.fmt or chat_format_from_args(cfg, default_tokenizer=cfg.model)
        build_training_set(cfg.output_dir, cfg.output_dir / "tokenized", fmt,
                           tokenizer_name=cfg.tokenizer or cfg.model, max_seq_len=cfg.max_seq_len,
                           loss_on=cfg.loss_on, keep_length=cfg.keep_length, progress_every=cfg.progress_every)
    if res.failed and res.unretryable:
        print(f"{res.failed} ids were {res.unretryable}; a rerun would fail the same way "
              f"(reasons in {ERRORS})", file=sys.stderr)
        return 1
    if res.failed:
        print(f"{res.failed} ids failed after retries (reasons in {ERRORS}); "
              "rerun the same command to retry them", file=sys.stderr)
        return 1
    return 0


def _write_manifest(out_dir: Path, args, ps, answered: int, failed: int, stats: dict) -> int:
    """Writes the manifest; returns how many answers in it are text-derived."""
    finish, prompt_tokens, gen_tokens, text_derived, longest = Counter(), 0, 0, 0, 0
    requested = set(ps.ids)
    for rec in read_jsonl(out_dir / RAW):
        longest = max(longest, len(rec.get("prompt_token_ids") or ()))  # of every record 01c reads: its --max-seq-len
        if rec.get("id") in requested:
            text_derived += rec.get("source") == "text"
            finish[rec.get("finish_reason")] += 1
            prompt_tokens += len(rec.get("prompt_token_ids") or ())
            gen_tokens += len(rec.get("token_ids") or ())
    error_types = Counter(r.get("error_type") for r in read_jsonl(out_dir / ERRORS))
    write_manifest(
        out_dir, STAGE, config=args.to_dict(),
        inputs={"prompts": ps.describe()},
        outputs={"raw_responses": describe_file(out_dir / RAW),
                 "errors": describe_file(out_dir / ERRORS) if (out_dir / ERRORS).exists() else None},
        counts={"requested": len(ps.ids), "answered": answered, "failed": failed,
                "finish_reasons": dict(finish), "error_types": dict(error_types),
                "prompt_tokens": prompt_tokens, "longest_prompt_tokens": longest, "generated_tokens": gen_tokens,
                "records_in_file": sum(1 for _ in read_jsonl(out_dir / RAW)), "text_derived": text_derived,
                "this_run": {"answered": stats["answered"], "failed": stats["failed"],
                             "retries": stats["retries"], "retry_causes": stats.get("retry_causes", {}),
                             "text_derived": stats.get("text_derived", 0)}},
        target={"model": args.model, "base_urls": list(args.base_url or ())},
        identity={**args.identity(), **source_identity(args, ps.source)}, text_derived=bool(text_derived),
        # what the servers said of their KV cache at this run's start, and the levels in flight this run
        # took (with auto: how each endpoint's level followed its load): observations, not settings
        **({"this_run": seen} if (seen := {k: stats[k] for k in ("server_cache", "concurrency") if stats.get(k)})
           else {}),
        **({"text_warning": TEXT_WARNING} if text_derived else {}))
    return text_derived
