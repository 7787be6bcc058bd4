"""The rerun policy, one for every stage: is this output directory the same run, to resume?

A run's identity is `run.json` in its output directory, written before any output:
    {"stage": <id>, "config": <the settings a resume must match>, "inputs": <what it was made from>}
`config` is the stage config's `identity()` (every field not marked resume=True); `inputs` is
whatever the stage derives from its inputs and must stay the same (hashes or manifest identities
of the inputs, the target's description, settings as resolved against them). A rerun whose
identity differs is refused in one line, naming the first differing key and both values:

    {out} holds a {stage} run with {key}={old!r}; this run has {key}={new!r}: rerun with the same
    settings to resume, or pass --overwrite to move the old output aside

`--overwrite` always starts over: the old output (the config's `outputs`, run.json, the manifest)
moves into `replaced-<UTC time>/` inside the directory, never deleted.

    with DirLock(cfg.output_dir, cfg.stage):
        rerun.prepare(cfg, inputs={"data_sha256": sha})   # refuse, or move aside, then record
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from eagle3_train.common.errors import PipelineError
from eagle3_train.common.manifest import MANIFEST
from eagle3_train.common.store import atomic_write_json
from eagle3_train.common.store import move_aside as _move

RUN = "run.json"
MAX_VALUE = 160  # characters of a value shown in the message (05 compares whole dicts)


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= MAX_VALUE else text[: MAX_VALUE - 3] + "..."


def record(stage: str, config: dict, inputs: dict | None = None) -> dict:
    """What run.json holds."""
    return {"stage": stage, "config": config, "inputs": inputs or {}}


def read_record(out: Path) -> dict | None:
    """The run.json of `out`, or None if there is none."""
    path = Path(out) / RUN
    if not path.exists():
        return None
    try:
        rec = json.loads(path.read_text())
    except json.JSONDecodeError:
        rec = None
    if not isinstance(rec, dict):
        raise PipelineError(f"{path} is not a valid run record; fix it or pass --overwrite to move it aside")
    return rec


def conflict(out: Path, new: dict, resumable: Iterable[str] = (), defaults: dict | None = None,
             aliases: dict | None = None) -> str | None:
    """None when `out` holds no record or the same run as `new` (a record()); else the one line
    naming the first difference. Keys in `resumable` are not compared (an older record may hold
    settings that have since become resumable); a setting the record lacks counts as its default
    in `defaults` (a run recorded before the setting existed resumes when the new run leaves it
    at its default). `aliases` {key: (recorded, now)}: a recorded value that now means `now` (a
    setting recorded before it was resolved: 04's draft_arch auto)."""
    old = read_record(out)
    if old is None:
        return None
    stage = new["stage"]
    if old.get("stage") != stage:
        return (f"{out} holds a {old.get('stage')} run, not a {stage} run: use another --output-dir, "
                "or pass --overwrite to move the old output aside")
    skip = set(resumable)
    for part in ("config", "inputs"):
        was, now = old.get(part) or {}, new.get(part) or {}
        for key in sorted(set(was) | set(now)):
            before = was[key] if key in was else (defaults or {}).get(key) if part == "config" else None
            if key in skip or before == now.get(key) or (aliases or {}).get(key) == (before, now.get(key)):
                continue
            return (f"{out} holds a {stage} run with {key}={_show(before)}; this run has "
                    f"{key}={_show(now.get(key))}: rerun with the same settings to resume, or pass "
                    "--overwrite to move the old output aside")
    return None


def claimed_without_record(out: Path, claims: Iterable[str]) -> str | None:
    """A claimed output file (non-empty) with no run.json beside it: not written under this policy."""
    out = Path(out)
    if (out / RUN).exists():
        return None
    for name in claims:
        p = out / name
        if p.exists() and (p.is_dir() or p.stat().st_size):
            return (f"{out} has {name} but no {RUN}: not written by this stage? use another "
                    "--output-dir, or pass --overwrite to move it aside")
    return None


def move_aside(out: Path, outputs: Iterable[str] | None = None) -> Path | None:
    """--overwrite: `outputs` plus run.json and the manifest (None: everything) go to
    `<out>/replaced-<UTC time>/`; returns that folder, or None if there was nothing to move."""
    names = None if outputs is None else [MANIFEST, RUN, *outputs]
    return _move(Path(out), names)


def check(out: Path, stage: str, config: dict, inputs: dict | None = None, *, overwrite: bool = False,
          outputs: Iterable[str] | None = None, resumable: Iterable[str] = (), claims: Iterable[str] = (),
          defaults: dict | None = None, aliases: dict | None = None, log=print) -> Path | None:
    """The policy for one output directory (call it holding the directory's lock): with
    `overwrite`, move the old output aside; else refuse another run's directory. Then record
    this run in run.json if it is new. Returns where the old output went, if it moved."""
    out = Path(out)
    new = record(stage, config, inputs)
    moved = None
    if overwrite:
        moved = move_aside(out, outputs)
        if moved is not None:
            log(f"--overwrite: moved the previous output to {moved}")
    else:
        why = conflict(out, new, resumable, defaults, aliases) or claimed_without_record(out, claims)
        if why:
            raise PipelineError(why)
    if not (out / RUN).exists():
        atomic_write_json(out / RUN, new)
    return moved


def prepare(cfg, inputs: dict | None = None, *, overwrite: bool | None = None, log=print) -> Path | None:
    """check() for a StageConfig: its stage, identity(), outputs, claims and --overwrite."""
    return check(cfg.output_dir, cfg.stage, cfg.identity(), inputs,
                 overwrite=getattr(cfg, "overwrite", False) if overwrite is None else overwrite,
                 outputs=cfg.outputs, resumable=cfg.resumable(), claims=cfg.claims,
                 defaults=cfg.identity_defaults(), aliases=getattr(cfg, "record_aliases", None), log=log)
