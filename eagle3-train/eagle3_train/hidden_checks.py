"""Checked reads of a 02 store, shared by 04 (training) and 05 (offline evaluation): a truncated
shard is refused before any work, a damaged or non-finite sample when it is read, each naming the
sample and its shard."""

from __future__ import annotations

from pathlib import Path

import torch

from .errors import PipelineError
from .hidden_store import committed_shards


def check_shards(directory: Path) -> None:
    """Cheap pre-flight: every committed shard is there with the size its index line recorded
    (a truncated copy is refused before training, not hours into it). Contents are checked as
    samples are read (`read_sample`)."""
    for e in committed_shards(directory).values():
        path = Path(directory) / e["shard"]
        size = path.stat().st_size if path.exists() else None
        if size is None or (e.get("bytes") is not None and size != e["bytes"]):
            what = "is missing" if size is None else f"has {size} bytes, its index line says {e['bytes']}"
            raise PipelineError(f"shard {e['shard']} of {directory} {what} (truncated or replaced); "
                                "rerun 02 with --validate / --repair")


def read_sample(store, sid: str):
    """One sample of a HiddenStates, with unreadable or non-finite features refused naming the
    sample and shard."""
    try:
        s = store.get(sid)
    except PipelineError:
        raise
    except Exception as e:  # safetensors raises its own types for damaged data
        raise PipelineError(f"cannot read sample {sid} from shard {store.shard_of(sid)} of {store.directory}: "
                            f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    for name in ("aux", "last", "topk_logprobs"):
        t = getattr(s, name)
        if t is not None and not bool(torch.isfinite(t).all()):
            raise PipelineError(f"sample {sid} in shard {store.shard_of(sid)} of {store.directory} has "
                                f"NaN/inf in {name}; rerun 02 with --validate / --repair")
    return s
