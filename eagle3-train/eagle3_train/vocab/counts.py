"""03's token counts: one streaming pass over the tokenized set, per split, and the frequency
file (token_freq*.npy + token_freq.json) that lets another run reuse them only when it provably
counted the same bytes with the same tokenizer, target vocabulary and split.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import io
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from eagle3_train.common.errors import PipelineError
from eagle3_train.common.split import SPLIT, is_heldout
from eagle3_train.common.store import ByteDigest, atomic_write_bytes, atomic_write_json
from eagle3_train.tokenize.dataset import TrainingSet, check_record
from eagle3_train.vocab.mapping import FREQ, FREQ_HELDOUT, FREQ_MANIFEST

FREQ_VERSION = 1
FLUSH_TOKENS = 1 << 20  # supervised tokens buffered before one bincount


# ----------------------------------------------------------------------------- counting

@dataclass
class Counts:
    total: np.ndarray  # int64 [V]
    heldout: np.ndarray  # int64 [V]
    samples: int
    heldout_samples: int

    @property
    def train(self) -> np.ndarray:
        return self.total - self.heldout

    @property
    def vocab_size(self) -> int:
        return len(self.total)


class _Bins:
    """Supervised ids buffered as arrays and counted with one bincount per ~1M tokens."""

    def __init__(self, vocab_size: int):
        self.counts = np.zeros(vocab_size, dtype=np.int64)
        self._buf: list[np.ndarray] = []
        self._n = 0

    def add(self, ids: np.ndarray) -> None:
        self._buf.append(ids)
        self._n += ids.size
        if self._n >= FLUSH_TOKENS:
            self.flush()

    def flush(self) -> None:
        if self._buf:
            self.counts += np.bincount(np.concatenate(self._buf), minlength=len(self.counts))
            self._buf, self._n = [], 0


def supervised_ids(rec: dict, vocab_size: int, where: str) -> np.ndarray:
    """The record's loss-masked ids as an array; every id (masked or not) must be a target id."""
    check_record(rec, where)
    sid = rec["id"]
    ids, mask = rec["input_ids"], rec["loss_mask"]
    try:
        # fromiter and bytes() convert these lists about twice as fast as np.asarray.
        ids = np.fromiter(ids, dtype=np.int64, count=len(ids))
        mask = np.frombuffer(bytes(mask), dtype=np.uint8)
    except (TypeError, ValueError, OverflowError):
        raise PipelineError(f"{where}: record {sid} has a non-integer input id or a loss_mask entry "
                            "other than 0/1") from None
    if mask.size and mask.max() > 1:
        raise PipelineError(f"{where}: record {sid} has a loss_mask entry other than 0/1")
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        bad = int(ids[(ids < 0) | (ids >= vocab_size)][0])
        raise PipelineError(f"{where}: record {sid} has token id {bad} outside the target vocabulary "
                            f"(0..{vocab_size - 1}); was it tokenized for another model?")
    return ids[mask.astype(bool)]


def count_tokens(data: TrainingSet, vocab_size: int, heldout_fraction: float, *,
                 progress=None) -> tuple[Counts, dict]:
    """One streaming pass over the set: counts per split, and the sha256/size of exactly the bytes
    counted (so the frequency file names the input it came from)."""
    read = ByteDigest()
    train, held = _Bins(vocab_size), _Bins(vocab_size)
    samples = held_samples = 0
    for line in data.lines(digest=read):
        rec = line.record
        sup = supervised_ids(rec, vocab_size, f"{data.path}:{line.lineno}")
        samples += 1
        if is_heldout(rec["id"], heldout_fraction):
            held.add(sup)
            held_samples += 1
        else:
            train.add(sup)
        if progress is not None:
            progress.update(line.size, tokens=int(sup.size))
    train.flush()
    held.flush()
    counts = Counts(train.counts + held.counts, held.counts, samples, held_samples)
    return counts, {"path": str(data.path.resolve()), "size": read.size, "sha256": read.hexdigest()}


# ----------------------------------------------------------------------------- frequency file

def freq_key(data: dict, tokenizer_fingerprint: str, vocab_size: int, heldout_fraction: float) -> dict:
    """What the counts depend on; any difference means they must be recounted."""
    return {"version": FREQ_VERSION, "input_sha256": data["sha256"], "input_size": data["size"],
            "tokenizer_fingerprint": tokenizer_fingerprint, "target_vocab_size": int(vocab_size),
            "heldout_fraction": float(heldout_fraction), "split": SPLIT}


def _npy_bytes(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a, allow_pickle=False)
    return buf.getvalue()


def save_counts(directory: Path, counts: Counts, key: dict, data: dict) -> None:
    """Arrays first, their manifest last: a kill in between leaves a manifest whose array hashes
    do not match, so the counts are recounted, never trusted half-written."""
    directory = Path(directory)
    files = {}
    for name, arr in ((FREQ, counts.total), (FREQ_HELDOUT, counts.heldout)):
        blob = _npy_bytes(np.ascontiguousarray(arr, dtype=np.int64))
        atomic_write_bytes(directory / name, blob)
        files[name] = hashlib.sha256(blob).hexdigest()
    atomic_write_json(directory / FREQ_MANIFEST, {
        "kind": "token_freq", "key": key, "files": files, "input": data,
        "samples": counts.samples, "heldout_samples": counts.heldout_samples,
        "supervised_tokens": int(counts.total.sum()),
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")})


def load_counts(directory: Path, key: dict) -> tuple[Counts | None, str]:
    """(counts, "") when the directory's frequency file was counted from exactly this input with
    these settings; else (None, why not) naming the differing value."""
    directory = Path(directory)
    mpath = directory / FREQ_MANIFEST
    if not mpath.exists():
        return None, f"no {FREQ_MANIFEST} in {directory}"
    try:
        meta = json.loads(mpath.read_text())
        old = meta["key"]
        files = meta["files"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return None, f"{mpath} is unreadable"
    for k, v in key.items():
        if old.get(k) != v:
            return None, f"{k} changed ({old.get(k)!r} -> {v!r})"
    arrays = []
    for name in (FREQ, FREQ_HELDOUT):
        p = directory / name
        if not p.exists():
            return None, f"{p} is missing"
        blob = p.read_bytes()
        if hashlib.sha256(blob).hexdigest() != files.get(name):
            return None, f"{p} does not match its manifest (interrupted write?)"
        arrays.append(np.load(io.BytesIO(blob), allow_pickle=False))
    total, held = arrays
    if total.shape != (key["target_vocab_size"],) or held.shape != total.shape:
        return None, f"{directory / FREQ} has shape {total.shape}, expected ({key['target_vocab_size']},)"
    return Counts(total, held, int(meta["samples"]), int(meta["heldout_samples"])), ""


# ----------------------------------------------------------------------------- counted or reused

def counts_for(data: TrainingSet, out_dir: Path, key_of: Callable[[dict], dict], *, vocab_size: int,
               heldout_fraction: float, freq_from: Path | None = None, recount: bool = False,
               log=print, progress: Callable[[], object] | None = None) -> tuple[Counts, dict, str]:
    """Counts for this input: reused from a frequency file that provably matches it (input sha256
    and size, tokenizer, target vocab, split), else counted. Returns (counts, input, source), source
    being "counted", "reused" (this output's own file) or "copied from <file>" (--freq-from)."""
    from eagle3_train.common.manifest import describe_file

    def count() -> tuple[Counts, dict]:
        if progress is None:
            return count_tokens(data, vocab_size, heldout_fraction)
        with progress() as p:
            return count_tokens(data, vocab_size, heldout_fraction, progress=p)

    if recount or (freq_from is None and not (Path(out_dir) / FREQ_MANIFEST).exists()):
        return *count(), "counted"
    desc = describe_file(data.path)
    source = Path(freq_from) if freq_from is not None else Path(out_dir)
    counts, why = load_counts(source, key_of(desc))
    if counts is not None:
        log(f"reusing token counts from {source / FREQ} (input sha256 {desc['sha256'][:12]} unchanged)")
        return counts, desc, "reused" if freq_from is None else f"copied from {source / FREQ}"
    if freq_from is not None:
        raise PipelineError(f"--freq-from {freq_from} does not match this input: {why}")
    log(f"note: recounting tokens: {source / FREQ} is stale ({why})")
    counts, counted = count()
    if counted["sha256"] != desc["sha256"]:
        raise PipelineError(f"{data.path} changed while it was being read; rerun when it is final")
    return counts, counted, "counted"
