"""Checks of a 02 store: 02's `--validate` (every shard against its index and the input), and the
checked reads shared by 04 (training) and 05 (offline evaluation): a truncated shard is refused
before any work, a damaged or non-finite sample when it is read, each naming the sample and its
shard."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open

from eagle3_train.common.errors import PipelineError
from eagle3_train.common.hidden_store import PLAIN, SHARD_META, committed_shards, nonfinite


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


# ----------------------------------------------------------------------------- validation

def _rows_chunks(total: int, chunk: int = 4096):
    for a in range(0, total, chunk):
        yield a, min(total, a + chunk)


def validate_shard(directory: Path, entry: dict, *, storage: str, n_aux: int, hidden: int,
                   topk: int = 0, expected: Callable[[str], tuple[list, list]] | None = None) -> list[str]:
    """Problems with one committed shard (empty list = fine): file size and header, tensor
    names and shapes, token ids and loss mask against the input, NaN/inf."""
    path = Path(directory) / entry["shard"]
    if not path.exists():
        return ["file missing"]
    size = path.stat().st_size
    if entry.get("bytes") is not None and size != entry["bytes"]:
        return [f"size {size} bytes, the index says {entry['bytes']} (truncated or overwritten)"]
    try:
        f = safe_open(str(path), framework="pt")
        meta = f.metadata() or {}
        keys = set(f.keys())
    except Exception as e:  # safetensors raises its own error types for a damaged header
        return [f"unreadable ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"]
    problems = []
    try:
        desc = json.loads(meta.get(SHARD_META, "{}"))
    except json.JSONDecodeError:
        desc = {}
    for name in ("ids", "offsets", "lengths"):
        if desc.get(name) != entry[name]:
            problems.append(f"header {name} differ from the index")
    total = entry["tokens"]
    want = {"input_ids": (total,), "loss_mask": (total,)}
    if storage in PLAIN:
        want |= {"aux": (total, n_aux, hidden), "last": (total, hidden)}
    else:
        want |= {"aux_q": (total, n_aux, hidden), "aux_scale": (total, n_aux)}
        want |= ({"last_q": (total, hidden), "last_scale": (total,)} if storage == "fp8"
                 else {"topk_ids": (total, topk), "topk_logprobs": (total, topk)})
    for name, shape in want.items():
        if name not in keys:
            problems.append(f"tensor {name} missing")
            continue
        got = tuple(f.get_slice(name).get_shape())
        if got != shape:
            problems.append(f"tensor {name} has shape {list(got)}, expected {list(shape)}")
    if problems:
        return problems
    try:
        ids = f.get_tensor("input_ids").long()
        mask = f.get_tensor("loss_mask").bool()
        if expected is not None:
            for sid, off, n in zip(entry["ids"], entry["offsets"], entry["lengths"]):
                want_ids, want_mask = expected(sid)
                if want_ids is None:
                    problems.append(f"sample {sid} is not in the input")
                elif ids[off:off + n].tolist() != list(want_ids):
                    problems.append(f"sample {sid}: token ids differ from the input")
                elif mask[off:off + n].tolist() != [bool(m) for m in want_mask]:
                    problems.append(f"sample {sid}: loss mask differs from the input")
        for name in sorted(keys - {"input_ids", "loss_mask", "topk_ids"}):
            bad = 0
            for a, b in _rows_chunks(total):
                bad += nonfinite(f.get_slice(name)[a:b])
            if bad:
                problems.append(f"tensor {name} has {bad} NaN/inf values")
    except Exception as e:
        problems.append(f"unreadable data ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
    return problems
