"""What a work directory holds, read without writing anything or taking a lock: every directory that
is a stage's output, found by its content (the runbook's $W/gen, $W/hidden, ... and the demo's 01b, 02,
... differ), and per directory the facts stage_state() decides on.

Only json/os/re here: a status must not import torch (seconds) on a box a stage keeps busy.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import re
from pathlib import Path

from eagle3_train.common import config as _ids
from eagle3_train.common.config import EVALUATE, EXTRACT, GENERATE, IMPORT_TEXT, TOKENIZE, TRAIN, VOCAB

# 01 (the prompt split) where this tree has it
SPLIT_PROMPTS = getattr(_ids, "SPLIT_PROMPTS", None)
# The pipeline in order: key, stage id (manifest / lock), script.
STAGES = ((("01", SPLIT_PROMPTS, "01_split_prompts.py"),) if SPLIT_PROMPTS else ()) + (
    ("01b", GENERATE, "01b_generate_synthetic.py"), ("01c", TOKENIZE, "01c_tokenize.py"),
    ("02", EXTRACT, "02_extract_hidden_states.py"), ("03", VOCAB, "03_build_vocab_mapping.py"),
    ("04", TRAIN, "04_train.py"), ("05", EVALUATE, "05_evaluate.py"))
KEYS = tuple(k for k, _, _ in STAGES)
# Stage ids as manifests, locks and progress.log lines write them -> key (01a writes 01b's format).
ID_KEY = {GENERATE: "01b", IMPORT_TEXT: "01b", "01b": "01b", "01a": "01b", TOKENIZE: "01c", "tokenize": "01c",
          EXTRACT: "02", "02": "02", VOCAB: "03", "03": "03", TRAIN: "04", "04": "04", EVALUATE: "05", "05": "05"}
if SPLIT_PROMPTS:
    ID_KEY[SPLIT_PROMPTS] = "01"
SPLIT_TRAIN, SPLIT_HELDOUT = "train.jsonl", "heldout.jsonl"  # 01 (split_prompts/config.py)

# File names of each stage's output (the stages' own constants import torch; tests/test_status.py
# checks these against them).
MANIFEST, LOCK, PROGRESS, RUN = "manifest.json", ".lock", "progress.log", "run.json"
RAW, ERRORS = "raw_responses.jsonl", "errors.jsonl"                       # 01b (generate/config.py)
DATA = "data.jsonl"                                                         # 01c (tokenize/dataset.py)
PLAN, INDEX, HEADER = "plan.json", "index.jsonl", "header.json"             # 02 (common/hidden_store.py)
MAPPING, COVERAGE, FREQ = "vocab_mapping.safetensors", "coverage.json", "token_freq.npy"  # 03 (vocab/mapping.py)
CKPT_DIR, METRICS, SCHEDULE, STOPPED, COMPLETE = ("checkpoints", "metrics.jsonl", "schedule.json", "stopped.json",
                                                  "COMPLETE")              # 04 (train/config.py, checkpoint.py)
REPORT, OFFLINE, ARMS_DIR = "report.json", "offline.json", "arms"          # 05 (evaluate/stage.py, report.py)
PILOT_REPORT = "pilot_report.json"
# Files that say which stage a directory holds when neither a manifest nor a lock does (none for
# 01: a train.jsonl of one's own is no split).
MARKERS = (("01b", (RAW, ERRORS)), ("01c", (DATA,)), ("02", (PLAN, INDEX, HEADER)), ("03", (MAPPING, COVERAGE, FREQ)),
           ("04", (CKPT_DIR, METRICS, SCHEDULE, STOPPED)), ("05", (REPORT, OFFLINE, ARMS_DIR)))

TAIL_BYTES = 64 * 1024       # of a log: its last lines are what matter, and a log can be GBs
COUNT_LIMIT = 256 * 1024**2  # JSONL counted line by line up to this size; above, progress.log's count
MAX_DIRS = 5000              # a WORK that is a home directory must still answer quickly
MAX_DEPTH = 4                # $W/pilot/gen/tokenized is the deepest stage directory the runbook makes

PROGRESS_RE = re.compile(
    r"^(?P<time>\S+) (?P<name>.+?) done (?P<done>\d+)/(?P<total>\d+) \([\d.]+%\) errors (?P<errors>\d+)"
    r" \| (?P<rate>[\d.]+) (?P<unit>\S+)/s \| (?P<tok_s>\d+) tok/s \| eta (?P<eta>[^|]+?)(?: \| (?P<rest>.*))?$")
PID_RE = re.compile(r"^(?P<stage>\S+) pid (?P<pid>\d+)")


# ----------------------------------------------------------------------------- small readers

def read_json(path: Path):
    """The JSON in `path`, or None (absent, unreadable, or torn)."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def tail_lines(path: Path, nbytes: int = TAIL_BYTES) -> list[str]:
    """The last lines of a text file (its first, partial one dropped when the read started mid-file)."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - nbytes))
            data = f.read()
    except OSError:
        return []
    lines = data.decode(errors="replace").splitlines()
    return lines[1:] if size > nbytes and lines else lines


def count_lines(path: Path, limit: int = COUNT_LIMIT) -> int | None:
    """Complete lines of a JSONL (a torn last line is not a record); None if absent or above `limit`."""
    try:
        if os.path.getsize(path) > limit:
            return None
        n = 0
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                n += chunk.count(b"\n")
        return n
    except OSError:
        return None


def parse_time(text: str) -> float | None:
    """progress.log's UTC timestamp -> epoch seconds."""
    try:
        return _dt.datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=_dt.timezone.utc).timestamp()
    except ValueError:
        return None


def parse_eta(text: str) -> float | None:
    """Progress's eta ('1 day, 2:03:04', '0:03:34', '?') -> seconds."""
    m = re.match(r"^(?:(\d+) days?, )?(\d+):(\d\d):(\d\d)$", text.strip())
    if not m:
        return None
    d, h, mi, s = (int(x or 0) for x in m.groups())
    return ((d * 24 + h) * 60 + mi) * 60 + s


# ----------------------------------------------------------------------------- liveness

def flock_holders(path: Path) -> set[int] | None:
    """Pids holding a flock on `path` per /proc/locks; None where the kernel does not say (not Linux)."""
    try:
        st = os.stat(path)
        with open("/proc/locks") as f:
            rows = f.read().splitlines()
    except OSError:
        return None
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    held, by_inode = set(), set()
    for row in rows:
        parts = row.split()
        if "->" in parts:  # a waiter, not a holder
            continue
        if len(parts) < 6 or parts[1] != "FLOCK":
            continue
        pid, where = parts[4], parts[5]
        if not pid.isdigit():
            continue
        if where == dev:
            held.add(int(pid))
        elif where.rsplit(":", 1)[-1] == str(st.st_ino):
            by_inode.add(int(pid))  # an overlay file system can report another device than stat()
    return held or by_inode


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return False
    return True


def lock_info(directory: Path) -> dict | None:
    """Who last took the directory's DirLock and whether it still holds it: {"stage", "pid", "live"}.
    flock dies with its holder, so a kill -9 leaves the file with a dead pid and no lock."""
    paths = [directory / LOCK]
    ranks = directory / ".locks"  # 02 under torchrun: one lock per rank
    if ranks.is_dir():
        paths += sorted(p / LOCK for p in ranks.iterdir() if (p / LOCK).is_file())
    found = None
    for path in paths:
        try:
            with open(path, "rb") as f:
                text = f.read(200).decode(errors="replace").strip()
        except OSError:
            continue
        m = PID_RE.match(text)
        pid = int(m["pid"]) if m else None
        holders = flock_holders(path)
        live = bool(holders) if holders is not None else (pid is not None and pid_alive(pid))
        if holders and pid not in holders:
            pid = min(holders)  # the file is rewritten just after the lock is taken
        info = {"stage": m["stage"] if m else None, "pid": pid, "live": live}
        if found is None or (live and not found["live"]):
            found = info
    return found


# ----------------------------------------------------------------------------- progress and errors

def progress_info(directory: Path) -> dict | None:
    """progress.log's last progress line, parsed: done/total, rate, eta, its note (start, finished,
    failed, stopped ...), its time; and the stage name its lines carry."""
    lines = tail_lines(directory / PROGRESS)
    for line in reversed(lines):
        m = PROGRESS_RE.match(line.strip())
        if not m:
            continue
        rest = [p.strip() for p in (m["rest"] or "").split(" | ") if p.strip()]
        note = rest[-1] if rest and (rest[-1] in ("start", "finished", "failed") or rest[-1].startswith("stopped")) \
            else None
        extra = rest[:-1] if note else rest
        return {"line": line.strip(), "name": m["name"], "done": int(m["done"]), "total": int(m["total"]),
                "errors": int(m["errors"]), "rate": float(m["rate"]), "unit": m["unit"],
                "eta_s": parse_eta(m["eta"]), "note": note, "extra": extra, "time": parse_time(m["time"])}
    return None


ERROR_RE = re.compile(r"^error: .+")
TRACE_RE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt)\b.*")
EXIT_RE = re.compile(r"(?:exit(?:ed)?(?: with| code| status)?|rc)[ =:]+(-?\d+)")


def log_files(directory: Path) -> list[Path]:
    """The logs a user or a stage keeps beside the output (`... 2>&1 | tee $W/draft/04.log`): every
    *.log, *.out, *.err but the vLLM servers' own (huge, and their errors are not the stage's)."""
    out = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return out
    for e in entries:
        if e.is_file() and e.name.endswith((".log", ".out", ".err")) and not e.name.startswith("vllm"):
            out.append(Path(e.path))
    return sorted(out)


def last_error(directory: Path) -> dict | None:
    """The newest `error:` line (or an uncaught exception's last line) in the directory's logs:
    {"line", "file", "mtime", "exit_code"}."""
    best = None
    for path in log_files(directory):
        lines = tail_lines(path)
        hit = None
        for i in range(len(lines) - 1, -1, -1):
            text = lines[i].strip()
            if ERROR_RE.match(text):
                hit = text
                break
            if TRACE_RE.match(text) and any(line.startswith("Traceback") for line in lines[:i]):
                hit = text
                break
        if hit is None:
            continue
        try:
            mtime = os.path.getmtime(path)
        except OSError:
            continue
        if best is None or mtime > best["mtime"]:
            m = EXIT_RE.search(hit)
            best = {"line": hit, "file": str(path), "mtime": mtime, "exit_code": int(m[1]) if m else None}
    return best


# ----------------------------------------------------------------------------- which stage

def identify(directory: Path, names: set[str]) -> tuple[str | None, dict | None, dict | None]:
    """(stage key or "pilot" or None, the manifest if any, the lock if any): by the manifest's
    stage, else the lock's holder, run.json's stage, progress.log's name, else the files present."""
    manifest = read_json(directory / MANIFEST) if MANIFEST in names else None
    lock = lock_info(directory) if LOCK in names or ".locks" in names else None
    if PILOT_REPORT in names or (lock and lock["stage"] == "pilot"):
        return "pilot", manifest, lock
    for stage in ((manifest or {}).get("stage") if isinstance(manifest, dict) else None,
                  (lock or {}).get("stage"),
                  (read_json(directory / RUN) or {}).get("stage") if RUN in names else None):
        if isinstance(stage, str) and stage in ID_KEY:
            return ID_KEY[stage], manifest if isinstance(manifest, dict) else None, lock
    if PROGRESS in names:
        prog = progress_info(directory)
        if prog and prog["name"].split()[0] in ID_KEY:
            return ID_KEY[prog["name"].split()[0]], None, lock
    for key, markers in MARKERS:
        if any(m in names for m in markers) or (key == "02" and any(n.startswith("shard-") for n in names)):
            return key, None, lock
    return None, None, lock


# ----------------------------------------------------------------------------- partial output per stage

def partial_01b(d: Path) -> dict:
    try:
        raw_bytes = os.path.getsize(d / RAW)
    except OSError:
        raw_bytes = None
    return {"answered": count_lines(d / RAW), "raw_bytes": raw_bytes}


def partial_02(d: Path) -> dict:
    plan = read_json(d / PLAN) or {}
    shards = samples = nbytes = 0
    for line in tail_lines(d / INDEX, COUNT_LIMIT) if (d / INDEX).exists() else []:
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a torn last line is no shard
        shards += 1
        samples += len(rec.get("ids") or [])
        nbytes += int(rec.get("bytes") or 0)
    return {"planned_samples": plan.get("samples"), "shards": shards, "samples": samples, "bytes": nbytes}


def partial_04(d: Path) -> dict:
    steps = []
    try:
        for e in os.scandir(d / CKPT_DIR):
            if e.name.startswith("step-") and os.path.exists(os.path.join(e.path, COMPLETE)):
                try:
                    steps.append(int(e.name[5:]))
                except ValueError:
                    pass
    except OSError:
        pass
    best = None
    last_val = None
    last_step = None
    for line in tail_lines(d / METRICS, 4 * TAIL_BYTES):
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("kind") == "train":
            last_step = rec.get("step")
        if rec.get("kind") == "val" and rec.get("acceptance_length") is not None:
            last_val = {"step": rec.get("step"), "acceptance_length": rec["acceptance_length"]}
            if best is None or rec["acceptance_length"] > best["acceptance_length"]:
                best = last_val
    schedule = read_json(d / SCHEDULE) or {}
    return {"checkpoints": sorted(steps), "total_steps": schedule.get("total_steps"), "stopped": read_json(d / STOPPED),
            "best_val": best, "last_val": last_val, "last_logged_step": last_step}


def partial_05(d: Path) -> dict:
    parts = []
    for name in sorted(os.listdir(d)) if d.is_dir() else []:
        if name == OFFLINE or (name.startswith("offline-k") and name.endswith(".json")):
            parts.append(name[:-5])
    if (d / ARMS_DIR).is_dir():
        parts += [f"arm {n[:-5]}" for n in sorted(os.listdir(d / ARMS_DIR)) if n.endswith(".json")]
    return {"parts": parts, "report": read_json(d / REPORT)}


PARTIAL = {"01b": partial_01b, "02": partial_02, "04": partial_04, "05": partial_05}


def newest_mtime(directory: Path, names) -> float | None:
    times = []
    for n in names:
        try:
            times.append(os.path.getmtime(directory / n))
        except OSError:
            pass
    return max(times) if times else None


def probe(directory: Path) -> dict | None:
    """The facts about one directory that stage_state() needs, or None when it holds no stage output."""
    directory = Path(directory)
    try:
        names = set(os.listdir(directory))
    except OSError:
        return None
    key, manifest, lock = identify(directory, names)
    if key is None:
        return None
    facts = {"key": key, "path": str(directory), "manifest": manifest, "lock": lock,
             "progress": progress_info(directory) if PROGRESS in names else None,
             "error": last_error(directory), "run": read_json(directory / RUN) if RUN in names else None,
             "mtime": newest_mtime(directory, names - {LOCK}),
             "files": sorted(n for n in names if not n.startswith("."))}
    if key in PARTIAL:
        facts["partial"] = PARTIAL[key](directory)
    return facts


# ----------------------------------------------------------------------------- the whole work directory

SKIP_DIRS = ("checkpoints", "export", "arms")  # inside a stage's output: its own parts


def scan(work: Path) -> tuple[list[dict], list[str]]:
    """Every stage directory under `work` (itself included), and notes (a pilot found, the search cut
    short). A stage's directory is not searched further, except 01b's (tokenized/, hidden/ inside)."""
    found, notes, seen = [], [], set()
    queue = [(Path(work), 0)]
    visited = 0
    while queue:
        directory, depth = queue.pop(0)
        try:
            real = os.path.realpath(directory)
        except OSError:
            continue
        if real in seen:
            continue
        seen.add(real)
        visited += 1
        if visited > MAX_DIRS:
            notes.append(f"stopped looking after {MAX_DIRS} directories; pass the work directory itself")
            break
        facts = probe(directory)
        if facts is not None and facts["key"] == "pilot":
            notes.append(f"pilot: {directory} (its own stages; see {directory / 'pilot_report.md'})")
            continue
        if facts is not None:
            found.append(facts)
            if facts["key"] != "01b":
                continue
        if depth >= MAX_DEPTH:
            continue
        try:
            subdirs = sorted(e.name for e in os.scandir(directory) if e.is_dir())
        except OSError:
            continue
        for name in subdirs:
            if name.startswith((".", "replaced-", "__")) or name in SKIP_DIRS:
                continue
            queue.append((directory / name, depth + 1))
    return found, notes
