"""A stage's state from its facts (probe.py), and the next command: pure functions, no file read.

  done         a complete manifest of the stage (its key figures in the line)
  running      a live process holds the directory's lock (pid, progress, rate, eta)
  failed       no live holder, no manifest, and the last run said why it stopped: an `error:` line
               or a traceback in a log beside the output, or progress.log closed as failed
  interrupted  no live holder, no manifest, partial output and no such word: a kill -9, a reboot,
               Ctrl-C (what a rerun of the same command redoes)
  not started  no directory holds the stage's output
"""

from __future__ import annotations

import os
import shlex

from eagle3_train.status.probe import ID_KEY, KEYS, SPLIT_HELDOUT, SPLIT_TRAIN, STAGES

DONE, RUNNING, FAILED, INTERRUPTED, NOT_STARTED = "done", "running", "failed", "interrupted", "not started"
# Directory names for stages not on disk yet: the runbook's $W layout, or the demo's numbered one.
RUNBOOK_DIRS = {"01": "prompts", "01b": "gen", "01c": "gen/tokenized", "02": "hidden", "03": "vocab", "04": "draft",
                "05": "eval"}
DEMO_DIRS = {"01": "prompts", "01b": "01b", "01c": "01b/tokenized", "02": "02", "03": "03", "04": "04", "05": "05"}
# An error older than the output's last change by more than this is an earlier run's.
STALE_ERROR_S = 5.0


# ----------------------------------------------------------------------------- numbers in words

def n(x) -> str:
    return f"{x:,}" if isinstance(x, int) else "?" if x is None else str(x)


def gb(nbytes) -> str:
    return "? GB" if not isinstance(nbytes, int | float) else f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e7 \
        else f"{nbytes / 1e6:.2f} MB"


def tokens(x) -> str:
    if not isinstance(x, int | float):
        return "?"
    return f"{x / 1e9:.2f}B" if x >= 1e9 else f"{x / 1e6:.2f}M" if x >= 1e6 else f"{int(x):,}"


def duration(seconds) -> str:
    if seconds is None:
        return "?"
    s = int(max(seconds, 0))
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    return (f"{d}d " if d else "") + (f"{h}h{m:02d}m" if d or h else f"{m}m{s:02d}s")


def al(x) -> str:
    return f"{x:.3f}" if isinstance(x, int | float) else "?"


# ----------------------------------------------------------------------------- per state

def done_line(key: str, manifest: dict, partial: dict | None = None) -> str:
    """The key figures a finished stage's manifest (and 05's report.json, in `partial`) holds."""
    c = manifest.get("counts") or {}
    if key == "01":
        return f"{n(c.get('prompts'))} prompts: {n(c.get('train'))} to train on, {n(c.get('heldout'))} held out"
    if key == "01b":
        text = (f"{n(c.get('answered'))} answers, {n(c.get('failed', 0))} failed, "
                f"{tokens(c.get('generated_tokens'))} generated tokens")
        if c.get("text_derived"):
            text += f" ({n(c['text_derived'])} re-wrapped from text)"
        if c.get("failed"):
            text += "; rerun the same command to retry the failed ids"
        return text
    if key == "01c":
        dropped = sum(v for k, v in c.items() if k.startswith("dropped_") and isinstance(v, int))
        return (f"{n(c.get('samples'))} samples, {tokens(c.get('tokens'))} tokens "
                f"({tokens(c.get('supervised_tokens'))} supervised), {n(dropped)} dropped")
    if key == "02":
        storage = (manifest.get("storage") or {}).get("format") or manifest.get("dtype")
        how = "; captured during 01b" if manifest.get("captured") else ""
        shards = f"{n(c.get('shards'))} shard{'' if c.get('shards') == 1 else 's'}"
        return (f"{n(c.get('samples'))} samples in {shards}, {gb(c.get('bytes'))}"
                + (f" ({storage})" if storage else "") + how)
    if key == "03":
        size = manifest.get("draft_vocab_size") or c.get("draft_vocab_size")
        cov = manifest.get("coverage") or {}
        text = f"draft vocab {n(size)}"
        if isinstance(cov.get("overall"), int | float):
            text += f", covers {100 * cov['overall']:.2f}% of supervised tokens"
            if isinstance(cov.get("heldout"), int | float):
                text += f" ({100 * cov['heldout']:.2f}% held-out)"
        return text
    if key == "04":
        best = manifest.get("best") or {}
        text = f"{n(c.get('steps'))} steps"
        if best.get("acceptance_length") is not None:
            text += f", best validation AL {al(best['acceptance_length'])} at step {n(best.get('step'))}"
        if c.get("exported_step") is not None:
            text += f", exported step {n(c['exported_step'])}"
        return text
    if key == "05":
        rep = (partial or {}).get("report") or {}
        off = (rep.get("offline") or {}).get("acceptance_length")
        spec = (((rep.get("online") or {}).get("arms") or {}).get("eagle3") or {}).get("spec") or {}
        sweep = rep.get("k_sweep") or {}
        parts = [f"K {rep['k']}" if rep.get("k") is not None else None,
                 f"offline AL {al(off)}" if off is not None else None,
                 f"vLLM AL {al(spec.get('acceptance_length'))}" if spec else None,
                 f"recommended K {sweep['recommended_k']}" if sweep.get("recommended_k") is not None else None]
        return ", ".join(p for p in parts if p) or f"{n(c.get('offline_samples'))} offline samples, " \
                                                    f"{n(c.get('arms'))} arms"
    return ""


def progress_text(prog: dict | None, now: float, running: bool) -> str:
    """'312/1,000 req (31.2%), 4.10 req/s, eta 12m03s (progress.log 40s ago)'."""
    if not prog:
        return "no progress line yet"
    done, total = prog["done"], prog["total"]
    pct = f" ({100 * done / total:.1f}%)" if total else ""
    text = f"{n(done)}/{n(total)} {prog['unit']}{pct}"
    age = now - prog["time"] if prog.get("time") else None
    if running:
        if prog["rate"] > 0:
            text += f", {prog['rate']:.2f} {prog['unit']}/s"
        if prog.get("eta_s") is not None and prog["note"] != "start":
            text += f", eta {duration(prog['eta_s'] - (age or 0))}"
    if prog.get("errors"):
        text += f", {n(prog['errors'])} errors"
    if age is not None:
        text += f" (progress.log {duration(age)} ago)"
    return text


def redo_line(key: str, facts: dict) -> str:
    """What a rerun of the same command redoes, from the partial output."""
    p, prog = facts.get("partial") or {}, facts.get("progress") or {}
    total = prog.get("total")
    if key == "01b":
        answered = p.get("answered") if p.get("answered") is not None else prog.get("done")
        of = f" of {n(total)}" if total else ""
        if answered is None:  # too big to count here and no progress.log
            return (f"raw_responses.jsonl holds {gb(p.get('raw_bytes'))} of answers; "
                    "rerun the same command to answer the rest")
        return f"{n(answered)}{of} ids answered; rerun the same command to answer the rest"
    if key == "02":
        planned = p.get("planned_samples") or total
        of = f" of {n(planned)}" if planned else ""
        return (f"{n(p.get('samples', 0))}{of} samples in {n(p.get('shards', 0))} committed shards "
                f"({gb(p.get('bytes', 0))}); rerun the same command to extract the rest")
    if key == "04":
        stopped = p.get("stopped")
        if stopped:
            return (f"{stopped.get('message') or 'stopped'} (exit {stopped.get('exit_code')}, "
                    f"{os.path.join(facts['path'], 'stopped.json')})")
        ckpts = p.get("checkpoints") or []
        total = p.get("total_steps") or total
        of = f" of {n(total)}" if total else ""
        if not ckpts:
            return f"no checkpoint yet{f' ({n(total)} steps planned)' if total else ''}: a rerun starts at step 0"
        text = f"last checkpoint step-{ckpts[-1]}{of}; rerun the same command to resume from it"
        if p.get("best_val"):
            text += f" (best validation AL so far {al(p['best_val']['acceptance_length'])})"
        return text
    if key == "05":
        parts = p.get("parts") or []
        if not parts:
            return "no part finished yet; rerun the same command"
        return f"finished: {', '.join(parts)}; rerun the same command to do the rest"
    if prog:
        return f"stopped at {n(prog['done'])}/{n(total)} {prog['unit']}; rerun the same command"
    return "nothing committed yet; rerun the same command"


def failed_why(facts: dict) -> str | None:
    """Why the last run stopped, if it said: its `error:` line (or progress.log's closing note)."""
    prog, err = facts.get("progress") or {}, facts.get("error")
    note = prog.get("note") or ""
    says_failed = note == "failed" or (note.startswith("stopped (") and "KeyboardInterrupt" not in note)
    newest = max((t for t in (prog.get("time"), facts.get("mtime")) if t), default=None)
    if err and (newest is None or err["mtime"] >= newest - STALE_ERROR_S or says_failed):
        code = f" (exit {err['exit_code']})" if err.get("exit_code") is not None else ""
        return f"{err['line']}{code} [{err['file']}]"
    stopped = (facts.get("partial") or {}).get("stopped")
    if stopped and stopped.get("exit_code") not in (None, 75):
        return f"{stopped.get('message')} (exit {stopped['exit_code']})"
    if says_failed:
        return f"progress.log ends '{note}'; its error line went to the terminal (rerun to see it)"
    return None


def is_complete(key: str, manifest) -> bool:
    return isinstance(manifest, dict) and manifest.get("complete") is True \
        and ID_KEY.get(manifest.get("stage")) == key


def stage_state(key: str, facts: dict | None, now: float) -> dict:
    """One stage's state and its line from the facts probe.probe() read (None: no directory holds
    its output). Pure: `now` is the time the progress ages are measured against."""
    if facts is None:
        return {"stage": key, "state": NOT_STARTED, "path": None, "pid": None, "line": "no output found under WORK"}
    lock = facts.get("lock") or {}
    out = {"stage": key, "path": facts["path"], "pid": None}
    if lock.get("live"):
        out |= {"state": RUNNING, "pid": lock.get("pid")}
        text = f"pid {lock.get('pid')}, {progress_text(facts.get('progress'), now, True)}"
        if facts.get("captured_by"):
            text += f" (captured by 01b in {facts['captured_by']})"
        p = facts.get("partial") or {}
        if key == "04" and p.get("checkpoints"):
            text += f"; last checkpoint step-{p['checkpoints'][-1]}"
            if p.get("best_val"):
                text += f", best validation AL so far {al(p['best_val']['acceptance_length'])}"
        if key == "02" and p.get("shards"):
            text += f"; {n(p['shards'])} shards committed ({gb(p.get('bytes'))})"
        return out | {"line": text}
    manifest = facts.get("manifest")
    if is_complete(key, manifest):
        return out | {"state": DONE, "line": done_line(key, manifest, facts.get("partial"))}
    why = failed_why(facts)
    if why:
        return out | {"state": FAILED, "line": why}
    text = redo_line(key, facts)
    note = (facts.get("progress") or {}).get("note") or ""
    if "KeyboardInterrupt" in note or note.startswith("stopped by"):
        text += f" (progress.log: {note})"
    return out | {"state": INTERRUPTED, "line": text}


# ----------------------------------------------------------------------------- all stages

def choose(states: list[dict], facts: list[dict]) -> tuple[dict, list[dict]]:
    """Of several directories holding one stage: the running one, else the newest; and the others."""
    pairs = sorted(zip(states, facts), key=lambda sf: (sf[0]["state"] != RUNNING, -(sf[1].get("mtime") or 0)))
    return pairs[0][0], [s for s, _ in pairs[1:]]


def summarize(found: list[dict], now: float) -> list[dict]:
    """Every stage in pipeline order: its state (stage_state) for the directory chosen, the others
    holding the same stage under "also"."""
    by_key: dict[str, list[dict]] = {k: [] for k in KEYS}
    for f in found:
        by_key.setdefault(f["key"], []).append(f)
    # 02 captured during 01b has no lock of its own: alive while its 01b is.
    running_01b = {f["path"]: f for f in by_key["01b"] if (f.get("lock") or {}).get("live")}
    for f in by_key["02"]:
        parent = os.path.dirname(f["path"])
        if parent in running_01b and not (f.get("lock") or {}).get("live"):
            f["lock"] = dict(running_01b[parent]["lock"])
            f["captured_by"] = parent
    rows = []
    for key in KEYS:
        facts = by_key[key]
        if not facts:
            rows.append(stage_state(key, None, now))
            continue
        states = [stage_state(key, f, now) for f in facts]
        row, others = choose(states, facts)
        if others:
            row["also"] = [{"path": o["path"], "state": o["state"]} for o in others]
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------- the next command

def _q(path) -> str:
    return shlex.quote(str(path))


def _target(found: list[dict]) -> str | None:
    """The target model, from the manifests and run records found (what later stages were made for)."""
    for f in sorted(found, key=lambda f: -KEYS.index(f["key"]) if f["key"] in KEYS else 0):
        m = f.get("manifest") or {}
        cfg = m.get("config") or {}
        rcfg = (f.get("run") or {}).get("config") or {}
        for value in ((m.get("target") or {}).get("name_or_path"), cfg.get("target"), rcfg.get("target"),
                      cfg.get("model") if f["key"] == "02" else None,
                      (m.get("tokenizer") or {}).get("name_or_path")):
            if isinstance(value, str) and value:
                return value
    return None


def command_for(key: str, out: str, paths: dict[str, str], found: list[dict], rerun: dict | None) -> str:
    """The stage's own command line: inputs from the stages before it, values read from their
    manifests (and from the stage's own run.json on a rerun); UPPER-CASE where nothing says."""
    target = _target(found) or "TARGET"
    script = dict((k, s) for k, _, s in STAGES)[key]
    head = f"uv run eagle3-train/{script}"
    rcfg = (rerun or {}).get("config") or {}
    if key == "01":
        args = f"--input {_q(rcfg.get('input') or 'PROMPTS')} --output-dir {_q(out)}"
    elif key == "01b":
        model = rcfg.get("model") or "SERVED_MODEL_NAME"
        prompts = rcfg.get("input") or (os.path.join(paths["01"], SPLIT_TRAIN) if "01" in paths else "PROMPTS.jsonl")
        args = (f"--input {_q(prompts)} --output-dir {_q(out)} "
                f"--base-url URL --model {_q(model)} --tokenize --tokenizer {_q(rcfg.get('target') or target)}")
    elif key == "01c":
        args = f"--raw-dir {_q(paths.get('01b', 'RAW_DIR'))} --output-dir {_q(out)} --tokenizer {_q(target)}"
    elif key == "02":
        args = f"--input {_q(paths.get('01c', 'TOKENIZED_DIR'))} --model {_q(target)} --output-dir {_q(out)}"
        if rcfg.get("storage"):
            args += f" --storage {rcfg['storage']}"
    elif key == "03":
        size = rcfg.get("draft_vocab_size") or 32000
        args = (f"--data {_q(paths.get('01c', 'TOKENIZED_DIR'))} --target {_q(target)} --output-dir {_q(out)} "
                f"--draft-vocab-size {size}")
    elif key == "04":
        args = (f"--hidden-states {_q(paths.get('02', 'HIDDEN_DIR'))} "
                f"--vocab-mapping {_q(paths.get('03', 'VOCAB_DIR'))} --target {_q(target)} --output-dir {_q(out)}")
    else:
        draft = os.path.join(paths["04"], "export") if "04" in paths else "DRAFT_DIR/export"
        heldout = os.path.join(paths["01"], SPLIT_HELDOUT) if "01" in paths else "HELDOUT_PROMPTS.jsonl"
        args = (f"--draft {_q(draft)} --target {_q(target)} --store {_q(paths.get('02', 'HIDDEN_DIR'))} "
                f"--output-dir {_q(out)} --prompts {_q(heldout)}")
    return f"{head} {args}"


def layout(found: list[dict], work: str) -> dict[str, str]:
    """Where a stage not on disk yet goes: the demo's numbered directories if WORK uses them, else the runbook's."""
    numbered = any(os.path.basename(f["path"])[:2] in ("01", "02", "03", "04", "05") for f in found)
    names = DEMO_DIRS if numbered else RUNBOOK_DIRS
    return {k: os.path.join(work, v) for k, v in names.items()}


def next_step(rows: list[dict], found: list[dict], work: str) -> dict:
    """{"stage", "why", "command"}: the rerun of the first stage interrupted or failed, else the first
    stage not done after the last one done (one not found before it was made elsewhere); while one
    runs, what follows it."""
    paths = {r["stage"]: r["path"] for r in rows if r["state"] in (DONE, RUNNING) and r["path"]}
    where = layout(found, work)
    if "01b" in paths:  # 01c's default output, and where 01b --capture-hidden-states puts 02
        where["01c"] = os.path.join(paths["01b"], "tokenized")
    last = max((i for i, r in enumerate(rows) if r["state"] in (DONE, RUNNING)), default=-1)
    running = [r for r in rows if r["state"] == RUNNING]
    if running:
        r = running[-1]
        follow = next((x for x in rows[last + 1:] if x["state"] != DONE), None)
        then = command_for(follow["stage"], follow["path"] or where[follow["stage"]], paths, found, None) \
            if follow else None
        return {"stage": follow["stage"] if follow else None,
                "why": f"{r['stage']} is running (pid {r['pid']}); when it finishes"
                       + ("" if follow else ", every stage is done"),
                "command": then}
    # a stage left interrupted or failed comes first (its inputs were there: it ran); else the
    # first one after the last done
    todo = next((r for r in rows if r["state"] in (INTERRUPTED, FAILED)), None) \
        or next((r for r in rows[last + 1:] if r["state"] != DONE), None)
    if todo is None:
        report = os.path.join(paths["05"], "report.md") if "05" in paths else None
        return {"stage": None, "why": "every stage is done" + (f"; the report: {report}" if report else ""),
                "command": None}
    rerun = next((f.get("run") for f in found if f["path"] == todo["path"]), None)
    why = {NOT_STARTED: f"{todo['stage']} is the first stage not done",
           INTERRUPTED: f"{todo['stage']} was interrupted: the same command resumes it",
           FAILED: f"{todo['stage']} failed: fix the cause, then the same command resumes it"}[todo["state"]]
    return {"stage": todo["stage"], "why": why,
            "command": command_for(todo["stage"], todo["path"] or where[todo["stage"]], paths, found, rerun)}
