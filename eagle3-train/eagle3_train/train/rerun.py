"""Is this the same run? run.json holds the config and input identities of the run in a
directory; a rerun resumes it only with the same settings (fields marked may_change aside) on the
same inputs, else it is refused, or with --overwrite the old run is moved aside."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import PipelineError
from ..manifest import MANIFEST
from ..store import atomic_write_json, clean_temp_files
from ..store import move_aside as move
from .checkpoint import CKPT_DIR
from .config import TrainConfig
from .metrics import METRICS

RUN = "run.json"


def open_run_dir(out: Path, config: TrainConfig, identity: dict) -> None:
    """Rank 0, under the directory lock: the run directory ready to (re)start this run."""
    out.mkdir(parents=True, exist_ok=True)
    clean_temp_files(out)
    clean_temp_files(out / CKPT_DIR)
    record = config.record()
    conflict = check_run(out, record, identity, TrainConfig.may_change_on_resume())
    if conflict and not config.overwrite:
        raise PipelineError(conflict)
    if conflict and (moved := move(out, (MANIFEST, RUN, METRICS, CKPT_DIR, "export", "curves.png",
                                         "progress.log"))):
        print(f"previous run moved to {moved}")
    if not (out / RUN).exists():
        atomic_write_json(out / RUN, {"config": record, "inputs": identity})


def check_run(out: Path, cfg: dict, identity: dict, may_change: set[str]) -> str | None:
    """None when `out` is new or holds this run; else the first difference, as one line."""
    path = out / RUN
    if not path.exists():
        return None
    try:
        old = json.loads(path.read_text())
    except json.JSONDecodeError:
        return f"{path} is not valid JSON"
    for k in sorted(set(old.get("config", {})) | set(cfg)):
        if k in may_change:
            continue
        if old.get("config", {}).get(k) != cfg.get(k):
            return (f"{out} holds a run started with {k}={old['config'].get(k)!r}, this run has "
                    f"{k}={cfg.get(k)!r}; rerun with the same settings to resume, or pass --overwrite "
                    "to move the old run aside")
    for k in sorted(identity):
        if (old.get("inputs") or {}).get(k) != identity[k]:
            return (f"{out} holds a run on other inputs: {k} was {(old.get('inputs') or {}).get(k)!r}, "
                    f"now {identity[k]!r}; pass --overwrite to move the old run aside")
    return None
