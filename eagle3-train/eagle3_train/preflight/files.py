"""Disk free under the work dir, the model folder complete, the tokenizer's special ids: each a
probe and a verdict."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

from eagle3_train.common.errors import PipelineError
from eagle3_train.preflight.verdict import FAIL, OK, WARN, Verdict

GB = 1e9

# ----------------------------------------------------------------------------- disk

HEADROOM = 1.1  # less than 10% over the plan's bytes is a warning: logs, temp files, a second try


def plan_bytes(path: str | Path) -> int:
    """The disk a run writes, from a plan JSON (`00_plan.py ... --json > plan.json`)."""
    try:
        plan = json.loads(Path(path).read_text())
        return int(plan["disk_total"])
    except OSError as e:
        raise PipelineError(f"--plan {path}: {e.strerror}") from None
    except (ValueError, KeyError, TypeError):
        raise PipelineError(f"--plan {path}: not 00_plan's --json output (no disk_total)") from None


def existing_parent(path: Path) -> Path:
    """The folder the work dir will be made in: its disk is the one that fills."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def disk_verdict(work_dir: str, free: int, need: int | None) -> Verdict:
    name = "disk"
    detail = f"{free / GB:,.1f} GB free under {work_dir}"
    if need is None:
        return Verdict(name, OK, detail, "pass --plan or --need-gb to compare with what the run writes")
    detail += f", the run writes about {need / GB:,.1f} GB"
    if free < need:
        return Verdict(name, FAIL, detail, f"free {(need - free) / GB:,.1f} GB or pass another --work-dir; "
                                           "02 --storage fp8-topk writes 38% of bf16's bytes")
    if free < need * HEADROOM:
        return Verdict(name, WARN, detail, "less than 10% to spare: logs, temp files and a rerun need room")
    return Verdict(name, OK, detail)


def probe_disk(work_dir: str) -> int:
    return shutil.disk_usage(existing_parent(Path(work_dir))).free


# ----------------------------------------------------------------------------- the model folder

INDEX = "model.safetensors.index.json"
MAX_HEADER = 1 << 30  # a safetensors header over 1 GiB is not one: the file is something else


def shard_problem(path: Path) -> tuple[str | None, set[str]]:
    """(what is wrong with a safetensors file or None, its tensor names). Its header states where
    each tensor's bytes end, so a file shorter than 8 + header + data is a partial download."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return "missing", set()
    if size == 0:
        return "empty (0 bytes)", set()
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"truncated ({size} bytes, no header)", set()
        n = struct.unpack("<Q", head)[0]
        if n > MAX_HEADER:
            return "not a safetensors file (header length nonsense)", set()
        if 8 + n > size:
            return f"truncated inside its header ({size:,} of at least {8 + n:,} bytes)", set()
        try:
            header = json.loads(f.read(n))
        except ValueError:
            return "unreadable header (not JSON)", set()
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    try:
        end = max((int(v["data_offsets"][1]) for v in tensors.values()), default=0)
    except (KeyError, TypeError, ValueError, IndexError):
        return "unreadable header (no data_offsets)", set()
    expected = 8 + n + end
    if size < expected:
        return f"truncated: {size:,} of {expected:,} bytes ({size / expected:.0%})", set(tensors)
    if size > expected:
        return f"{size - expected:,} bytes past its data (written over by something else?)", set(tensors)
    return None, set(tensors)


def model_verdict(folder: Path) -> Verdict:
    """Every file the index names present, whole, and holding the tensors the index says it holds."""
    name = "model"
    if not (folder / "config.json").is_file():
        return Verdict(name, FAIL, f"{folder} has no config.json", "download the whole checkpoint folder")
    index = folder / INDEX
    if index.is_file():
        try:
            where = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError):
            return Verdict(name, FAIL, f"{index} has no weight_map", "download the index again")
        wanted: dict[str, set[str]] = {}
        for tensor, file in where.items():
            wanted.setdefault(file, set()).add(tensor)
    elif (folder / "model.safetensors").is_file():
        wanted = {"model.safetensors": set()}
    else:
        return Verdict(name, FAIL, f"{folder} has no {INDEX} and no model.safetensors",
                       "this pipeline reads safetensors checkpoints; download them")
    problems, nbytes = [], 0
    for file in sorted(wanted):
        problem, held = shard_problem(folder / file)
        if problem is None and (absent := wanted[file] - held):
            problem = f"lacks {len(absent)} tensor(s) the index places there (e.g. {min(absent)})"
        if problem:
            problems.append(f"{file}: {problem}")
        else:
            nbytes += (folder / file).stat().st_size
    if problems:
        shown = "; ".join(problems[:3]) + (f"; and {len(problems) - 3} more" if len(problems) > 3 else "")
        return Verdict(name, FAIL, f"{len(problems)} of {len(wanted)} weight files bad: {shown}",
                       "download those files again (`hf download` resumes and replaces partial files)")
    return Verdict(name, OK, f"{len(wanted)} weight file{'s' if len(wanted) > 1 else ''}, {nbytes / GB:,.2f} GB, "
                             f"each whole{', every tensor of the index present' if index.is_file() else ''}")


# ----------------------------------------------------------------------------- the tokenizer

# Kimi-K2 / K2.5's think tokens (facts: assert them at run time, never hard-code silently): a
# Kimi target whose tokenizer puts them elsewhere came with another model's tokenizer.
KIMI_MODEL_TYPES = ("kimi_k25", "kimi_k2")
KIMI_THINK_IDS = {"<think>": 163606, "</think>": 163607}


def tokenizer_facts(tokenizer, *, reasoning: bool = True) -> dict:
    """What the stages will ask of the tokenizer, asked the stages' way (ChatFormat), plus how its
    think tokens round-trip. A PipelineError from ChatFormat is the answer, not an exception."""
    from eagle3_train.common.tokenization import THINK_END, THINK_START, ChatFormat

    facts = {"vocab": len(tokenizer), "error": None}
    try:
        fmt = ChatFormat.from_tokenizer(tokenizer, reasoning=reasoning)
    except PipelineError as e:
        return {**facts, "error": str(e)}
    facts.update(think_start_id=fmt.think_start_id, think_end_id=fmt.think_end_id,
                 end_of_turn_id=fmt.end_of_turn_id, eos_id=tokenizer.eos_token_id)
    if reasoning:
        text = f"{THINK_START}2{THINK_END}"
        ids = fmt.encode(text)
        facts.update(encoded=ids, decoded=tokenizer.decode(ids, skip_special_tokens=False),
                     digit=fmt.encode("2"), text=text)
    return facts


def tokenizer_verdict(facts: dict, *, model_type: str | None = None, target_vocab: int | None = None,
                      target: str = "") -> Verdict:
    name = "tokenizer"
    if facts.get("error"):
        return Verdict(name, FAIL, facts["error"])
    detail = f"vocab {facts['vocab']:,}"
    if facts.get("think_start_id") is not None:
        detail += f", <think> {facts['think_start_id']}, </think> {facts['think_end_id']}"
    detail += f", end of turn {facts['end_of_turn_id']}, EOS {facts['eos_id']}"
    if target_vocab is not None:
        try:
            from eagle3_train.common.target_layout import check_vocab

            check_vocab(target_vocab, facts["vocab"], target)
        except PipelineError as e:
            return Verdict(name, FAIL, f"{detail}; {e}", "pass the target's own tokenizer")
    if facts.get("think_start_id") is not None:
        want = [facts["think_start_id"], *facts["digit"], facts["think_end_id"]]
        if facts["encoded"] != want:
            return Verdict(name, FAIL, f"{detail}; {facts['text']!r} encodes to {facts['encoded']}, not {want}: the "
                                       "think tokens are not single special tokens in text",
                           "a tokenizer whose <think>/</think> are added tokens (the target's own)")
        if facts["decoded"] != facts["text"]:
            return Verdict(name, FAIL, f"{detail}; {facts['text']!r} decodes back as {facts['decoded']!r}",
                           "a tokenizer that round-trips its think tokens (the target's own)")
        if model_type in KIMI_MODEL_TYPES:
            got = {"<think>": facts["think_start_id"], "</think>": facts["think_end_id"]}
            if got != KIMI_THINK_IDS:
                return Verdict(name, FAIL, f"{detail}; a {model_type} target's think tokens are "
                                           f"{KIMI_THINK_IDS['<think>']}/{KIMI_THINK_IDS['</think>']}",
                               "pass the target's own tokenizer (--tokenizer)")
    return Verdict(name, OK, detail)


def model_type_and_vocab(folder: Path) -> tuple[str | None, int | None]:
    """The config's model_type and its language model's vocab_size (a wrapper's text_config)."""
    from eagle3_train.common.target_layout import raw_config

    raw = raw_config(folder) or {}
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    vocab = text.get("vocab_size")
    return raw.get("model_type"), vocab if isinstance(vocab, int) else None
