"""The draft vocabulary: which target tokens the draft can propose, chosen by how often the target
emits them in the supervised (loss-masked) part of the training set, and how much that covers.

Files in a 03 output directory:
  token_freq.npy           int64 [V]  counts of supervised target tokens, whole set
  token_freq_heldout.npy   int64 [V]  the same, held-out samples only (train = total - heldout)
  token_freq.json          the counts' own manifest: input sha256/size, tokenizer fingerprint,
                           target vocab, split; written after the arrays, checked before any reuse
  vocab_mapping.safetensors  d2t int64 [K] (target = draft + d2t[draft]), t2d bool [V]
  coverage.json / coverage.png   coverage at K (overall and held-out) and the curve over sizes
  manifest.json            written last (stage 03_build_vocab_mapping)

Draft ids are ordered by ascending target id, as speculators and vLLM expect.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from eagle3_train.common.config import VOCAB
from eagle3_train.common.errors import PipelineError
from eagle3_train.common.manifest import read_manifest
from eagle3_train.common.store import atomic_write_bytes

STAGE = VOCAB
FREQ = "token_freq.npy"
FREQ_HELDOUT = "token_freq_heldout.npy"
FREQ_MANIFEST = "token_freq.json"
MAPPING = "vocab_mapping.safetensors"
COVERAGE_JSON = "coverage.json"
COVERAGE_PNG = "coverage.png"
OUTPUTS = (MAPPING, COVERAGE_JSON, COVERAGE_PNG)  # what --overwrite moves aside; the counts stay reusable


# ----------------------------------------------------------------------------- selection

def select_vocab(counts: np.ndarray, k: int, required: Iterable[int] = ()) -> np.ndarray:
    """The K target ids of the draft vocabulary, ascending: the `required` ids, then the most
    frequent others (ties: lower id first; unseen ids fill up in id order, as speculators does)."""
    counts = np.asarray(counts)
    v = len(counts)
    req = np.unique(np.asarray(list(required), dtype=np.int64))
    if not 0 < k <= v:
        raise PipelineError(f"draft vocab size {k} must be between 1 and the target vocab ({v})")
    if req.size and (req[0] < 0 or req[-1] >= v):
        raise PipelineError(f"required token id {int(req[-1] if req[-1] >= v else req[0])} is outside "
                            f"the target vocabulary (0..{v - 1})")
    if req.size > k:
        raise PipelineError(f"draft vocab size {k} is smaller than the {req.size} tokens it must "
                            f"always contain ({req.tolist()})")
    order = np.argsort(-counts, kind="stable")
    forced = np.zeros(v, dtype=bool)
    forced[req] = True
    rest = order[~forced[order]]
    return np.sort(np.concatenate([req, rest[: k - req.size]]))


def mappings(selected: np.ndarray, target_vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """d2t int64 [K] offsets (target = draft + d2t[draft]) and t2d bool [V]."""
    selected = np.asarray(selected, dtype=np.int64)
    if selected.size and np.any(np.diff(selected) <= 0):
        raise ValueError("selected ids must be strictly ascending")
    d2t = selected - np.arange(selected.size, dtype=np.int64)
    t2d = np.zeros(target_vocab_size, dtype=bool)
    t2d[selected] = True
    return d2t, t2d


def check_mappings(d2t: np.ndarray, t2d: np.ndarray) -> np.ndarray:
    """Raise PipelineError unless d2t/t2d describe the same ascending id set; returns the ids."""
    d2t, t2d = np.asarray(d2t), np.asarray(t2d)
    if d2t.ndim != 1 or t2d.ndim != 1 or t2d.dtype != np.bool_ or d2t.dtype != np.int64:
        raise PipelineError(f"vocab mapping has d2t {d2t.dtype}{list(d2t.shape)} and t2d "
                            f"{t2d.dtype}{list(t2d.shape)}; expected int64 [K] and bool [V]")
    target = d2t + np.arange(d2t.size, dtype=np.int64)
    if d2t.size and (target[0] < 0 or target[-1] >= t2d.size or np.any(np.diff(target) <= 0)):
        raise PipelineError("vocab mapping d2t does not give ascending target ids inside the vocabulary")
    if int(t2d.sum()) != d2t.size or not np.array_equal(np.flatnonzero(t2d), target):
        raise PipelineError(f"vocab mapping is inconsistent: t2d marks {int(t2d.sum())} tokens, "
                            f"d2t maps {d2t.size}")
    return target


def save_mapping(path: Path, d2t: np.ndarray, t2d: np.ndarray) -> None:
    from safetensors.numpy import save

    atomic_write_bytes(path, save({"d2t": np.ascontiguousarray(d2t, dtype=np.int64),
                                   "t2d": np.ascontiguousarray(t2d, dtype=np.bool_)}))


@dataclass
class VocabMapping:
    d2t: np.ndarray
    t2d: np.ndarray
    manifest: dict

    @property
    def draft_vocab_size(self) -> int:
        return self.d2t.size

    @property
    def target_vocab_size(self) -> int:
        return self.t2d.size

    @property
    def target_ids(self) -> np.ndarray:
        return self.d2t + np.arange(self.d2t.size, dtype=np.int64)


def read_mapping(directory: Path) -> VocabMapping:
    """A complete 03 output, checked: what 04 and 05 load."""
    from safetensors.numpy import load_file

    directory = Path(directory)
    manifest = read_manifest(directory, STAGE)
    t = load_file(str(directory / MAPPING))
    if "d2t" not in t or "t2d" not in t:
        raise PipelineError(f"{directory / MAPPING} has no d2t/t2d tensors")
    check_mappings(t["d2t"], t["t2d"])
    return VocabMapping(t["d2t"], t["t2d"], manifest)

# ----------------------------------------------------------------------------- tokens to keep

def required_tokens(fmt, extra: Sequence[str] = ()) -> list[dict]:
    """The tokens the draft must be able to propose, whatever their counts: the ones that end the
    reasoning, the turn and the sequence (ids from the ChatFormat / tokenizer, never hard-coded)."""
    from eagle3_train.common.tokenization import token_id

    tok = fmt.tokenizer
    found = []
    if fmt.reasoning:
        found += [("think_start", fmt.think_start_id), ("think_end", fmt.think_end_id)]
    found.append(("end_of_turn", fmt.end_of_turn_id))
    if getattr(tok, "eos_token_id", None) is not None:
        found.append(("eos", tok.eos_token_id))
    for s in extra:
        tid = token_id(tok, s)
        if tid is None:
            raise PipelineError(f"--keep-tokens {s!r} is not a single token of the tokenizer")
        found.append(("keep", tid))
    out, seen = [], set()
    for role, tid in found:
        if tid is not None and tid not in seen:
            seen.add(tid)
            out.append({"role": role, "id": int(tid), "token": tok.convert_ids_to_tokens(int(tid))})
    return out


def recorded_format(data_manifest: dict) -> dict:
    """The ChatFormat the tokenize stage recorded (fmt.describe()), wherever it put it, or {}."""
    for key in ("chat_format", "format", "fmt"):
        if isinstance(data_manifest.get(key), dict):
            return data_manifest[key]
    for v in data_manifest.values():
        if isinstance(v, dict) and "end_of_turn_id" in v and "reasoning" in v:
            return v
    return {}
