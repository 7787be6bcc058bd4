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

import datetime as _dt
import hashlib
import io
import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import PipelineError
from .manifest import MANIFEST, read_manifest
from .store import atomic_write_bytes, atomic_write_json

STAGE = "03_build_vocab_mapping"
FREQ = "token_freq.npy"
FREQ_HELDOUT = "token_freq_heldout.npy"
FREQ_MANIFEST = "token_freq.json"
MAPPING = "vocab_mapping.safetensors"
COVERAGE_JSON = "coverage.json"
COVERAGE_PNG = "coverage.png"
OUTPUTS = (MAPPING, COVERAGE_JSON, COVERAGE_PNG, MANIFEST)
FREQ_VERSION = 1
SPLIT = "blake2b-64(id) / 2**64 < heldout_fraction"
FLUSH_TOKENS = 1 << 20  # supervised tokens buffered before one bincount


# ----------------------------------------------------------------------------- held-out split

def is_heldout(sample_id, fraction: float) -> bool:
    """Fixed split by id: the same sample is held out in every run, whatever the file order."""
    if fraction <= 0:
        return False
    h = int.from_bytes(hashlib.blake2b(str(sample_id).encode(), digest_size=8).digest(), "big")
    return h / 2.0**64 < fraction


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
    sid = rec.get("id", "?")
    for key in ("id", "input_ids", "loss_mask"):
        if key not in rec:
            raise PipelineError(f"{where}: record {sid} has no {key!r}")
    ids, mask = rec["input_ids"], rec["loss_mask"]
    if not isinstance(ids, list) or not isinstance(mask, list):
        raise PipelineError(f"{where}: record {sid}: input_ids and loss_mask must be lists")
    try:
        # fromiter and bytes() convert these lists about twice as fast as np.asarray.
        ids = np.fromiter(ids, dtype=np.int64, count=len(ids))
        mask = np.frombuffer(bytes(mask), dtype=np.uint8)
    except (TypeError, ValueError, OverflowError):
        raise PipelineError(f"{where}: record {sid} has a non-integer input id or a loss_mask entry "
                            "other than 0/1") from None
    if mask.size and mask.max() > 1:
        raise PipelineError(f"{where}: record {sid} has a loss_mask entry other than 0/1")
    if ids.shape != mask.shape:
        raise PipelineError(f"{where}: record {sid} has {ids.size} input_ids but {mask.size} "
                            "loss_mask entries")
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        bad = int(ids[(ids < 0) | (ids >= vocab_size)][0])
        raise PipelineError(f"{where}: record {sid} has token id {bad} outside the target vocabulary "
                            f"(0..{vocab_size - 1}); was it tokenized for another model?")
    return ids[mask.astype(bool)]


def count_tokens(path: Path, vocab_size: int, heldout_fraction: float, *, progress=None) -> tuple[Counts, dict]:
    """One streaming pass over data.jsonl: counts per split, and the sha256/size of exactly the
    bytes counted (so the frequency file names the input it came from)."""
    path = Path(path)
    h = hashlib.sha256()
    size = 0
    train, held = _Bins(vocab_size), _Bins(vocab_size)
    samples = held_samples = 0
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            h.update(raw)
            size += len(raw)
            if not raw.strip():
                continue
            try:
                rec = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise PipelineError(f"{path}:{lineno}: malformed JSON line "
                                    f"({raw[:60].decode(errors='replace')!r}...)") from None
            if not isinstance(rec, dict):
                raise PipelineError(f"{path}:{lineno}: expected a JSON object")
            sup = supervised_ids(rec, vocab_size, f"{path}:{lineno}")
            samples += 1
            if is_heldout(rec["id"], heldout_fraction):
                held.add(sup)
                held_samples += 1
            else:
                train.add(sup)
            if progress is not None:
                progress.update(len(raw), tokens=int(sup.size))
    train.flush()
    held.flush()
    counts = Counts(train.counts + held.counts, held.counts, samples, held_samples)
    return counts, {"path": str(path.resolve()), "size": size, "sha256": h.hexdigest()}


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


# ----------------------------------------------------------------------------- coverage

def coverage_curve(choose: np.ndarray, evaluate: np.ndarray, sizes: Sequence[int],
                   required: Iterable[int] = ()) -> list[float | None]:
    """Share of `evaluate`'s tokens inside the vocabulary select_vocab(choose, k, required) would
    pick, for each k in sizes; one sort and one cumsum for all sizes."""
    total = int(evaluate.sum())
    if total == 0:
        return [None] * len(sizes)
    req = np.unique(np.asarray(list(required), dtype=np.int64))
    forced = np.zeros(len(choose), dtype=bool)
    forced[req] = True
    order = np.argsort(-np.asarray(choose), kind="stable")
    rest = order[~forced[order]]
    cum = np.concatenate([[0], np.cumsum(evaluate[rest])])
    base = int(evaluate[req].sum())
    return [(base + int(cum[min(k - req.size, rest.size)])) / total if k >= req.size else None
            for k in sizes]


def size_for_coverage(counts: np.ndarray, required: Iterable[int],
                      targets: Sequence[float] = (0.9, 0.95, 0.99, 0.999)) -> dict[str, int | None]:
    """Smallest K whose vocabulary (chosen and measured on `counts`) covers each target share."""
    total = int(counts.sum())
    if total == 0:
        return {str(t): None for t in targets}
    req = np.unique(np.asarray(list(required), dtype=np.int64))
    forced = np.zeros(len(counts), dtype=bool)
    forced[req] = True
    rest = np.sort(counts[~forced])[::-1]
    cov = (int(counts[req].sum()) + np.concatenate([[0], np.cumsum(rest)])) / total
    out = {}
    for t in targets:
        i = int(np.searchsorted(cov, t - 1e-12))
        out[str(t)] = req.size + i if i < cov.size else None
    return out


def default_sizes(vocab_size: int, k: int, n_required: int) -> list[int]:
    """A log-spaced grid over the vocabulary, the usual sizes, and the chosen K."""
    lo = max(n_required, vocab_size // 1024, 1)
    grid = np.unique(np.round(np.geomspace(lo, vocab_size, 11)).astype(int)).tolist()
    usual = [s for s in (4096, 8192, 16384, 32000, 65536) if s <= vocab_size]
    return sorted({*grid, *usual, k})


def coverage_report(counts: Counts, k: int, required: list[dict], sizes: Sequence[int],
                    heldout_fraction: float) -> dict:
    """Coverage of the chosen size overall (vocab and share from the whole set) and on held-out
    samples (vocab chosen on the rest), plus the curve over `sizes`."""
    req_ids = [r["id"] for r in required]
    train = counts.train
    sizes = sorted({k, *(int(s) for s in sizes if len(set(req_ids)) <= s <= counts.vocab_size and s > 0)})
    overall = coverage_curve(counts.total, counts.total, sizes, req_ids)
    held = coverage_curve(train, counts.heldout, sizes, req_ids)
    on_train = coverage_curve(train, train, sizes, req_ids)
    ranks = np.empty(counts.vocab_size, dtype=np.int64)
    ranks[np.argsort(-counts.total, kind="stable")] = np.arange(counts.vocab_size)
    req_out = [{**r, "count": int(counts.total[r["id"]]), "rank_by_count": int(ranks[r["id"]]),
                "chosen_by_count_alone": bool(ranks[r["id"]] < k)} for r in required]
    at_k = dict(zip(sizes, zip(overall, held, on_train)))[k]
    sup_total, sup_held = int(counts.total.sum()), int(counts.heldout.sum())
    return {
        "target_vocab_size": counts.vocab_size,
        "draft_vocab_size": k,
        "coverage": {"overall": at_k[0], "heldout": at_k[1], "train": at_k[2]},
        "samples": {"total": counts.samples, "train": counts.samples - counts.heldout_samples,
                    "heldout": counts.heldout_samples},
        "supervised_tokens": {"total": sup_total, "train": sup_total - sup_held, "heldout": sup_held},
        "distinct_tokens_seen": int(np.count_nonzero(counts.total)),
        "heldout_fraction": heldout_fraction,
        "split": SPLIT,
        "required_tokens": req_out,
        "size_for_coverage": size_for_coverage(counts.total, req_ids),
        "curve": [{"size": s, "overall": o, "heldout": h, "train": t}
                  for s, o, h, t in zip(sizes, overall, held, on_train)],
    }


def plot_coverage(report: dict, path: Path) -> None:
    """coverage.png: share covered against draft vocab size, overall and held-out."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    curve = report["curve"]
    xs = [c["size"] for c in curve]
    ax.plot(xs, [100 * c["overall"] for c in curve], "o-", label="overall (vocab from all samples)")
    held = [(c["size"], 100 * c["heldout"]) for c in curve if c["heldout"] is not None]
    if held:
        ax.plot(*zip(*held), "s--", label="held-out (vocab from the other samples)")
    k, cov = report["draft_vocab_size"], report["coverage"]
    ax.axvline(k, color="gray", lw=0.8)
    label = f"K={k}: {100 * cov['overall']:.2f}%"
    if cov["heldout"] is not None:
        label += f" (held-out {100 * cov['heldout']:.2f}%)"
    ax.annotate(label, (k, 100 * cov["overall"]), textcoords="offset points", xytext=(6, -30),
                fontsize=8, bbox={"boxstyle": "round", "fc": "white", "alpha": 0.8})
    ax.set_xscale("log")
    ax.set_xlabel("draft vocabulary size K")
    ax.set_ylabel("supervised target tokens covered (%)")
    st = report["supervised_tokens"]
    ax.set_title(f"draft vocab coverage: {st['total']:,} supervised tokens, "
                 f"{report['samples']['total']:,} samples, target vocab {report['target_vocab_size']:,}",
                 fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    atomic_write_bytes(path, buf.getvalue())


# ----------------------------------------------------------------------------- tokens to keep

def required_tokens(fmt, extra: Sequence[str] = ()) -> list[dict]:
    """The tokens the draft must be able to propose, whatever their counts: the ones that end the
    reasoning, the turn and the sequence (ids from the ChatFormat / tokenizer, never hard-coded)."""
    from .tokenization import token_id

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


# ----------------------------------------------------------------------------- rerun policy

def config_conflict(out_dir: Path, config: dict, keys: Iterable[str]) -> str | None:
    """The first output-affecting setting that differs from the complete output already in
    out_dir, as one line; None if there is none (or nothing complete there)."""
    path = Path(out_dir) / MANIFEST
    if not path.exists():
        return None
    try:
        old = json.loads(path.read_text())
    except json.JSONDecodeError:
        return None
    if old.get("stage") != STAGE or not old.get("complete"):
        return None
    for k in keys:
        if old.get("config", {}).get(k) != config.get(k):
            return (f"{out_dir} already holds a vocab mapping built with {k}={old['config'].get(k)!r}, "
                    f"this run asks for {config.get(k)!r}; pass --overwrite to replace it (the old "
                    "files are moved aside) or choose another --out")
    return None


def already_complete(out_dir: Path, data_path: Path) -> bool:
    """The complete output in out_dir was built from exactly this input and its files are intact
    (the settings were compared by config_conflict): a rerun has nothing to do."""
    from .manifest import describe_file

    try:
        old = read_manifest(out_dir, STAGE)
    except PipelineError:
        return False
    recorded = old.get("inputs", {}).get("data", {})
    if recorded.get("size") != Path(data_path).stat().st_size:
        return False
    for name, desc in old.get("outputs", {}).items():
        p = Path(out_dir) / name
        if not p.exists() or describe_file(p).get("sha256") != desc.get("sha256"):
            return False
    return describe_file(data_path)["sha256"] == recorded.get("sha256")


def move_aside(out_dir: Path) -> Path | None:
    """The previous outputs (not the token counts, which stay reusable) go to replaced-<time>/."""
    from .store import move_aside as move

    return move(out_dir, OUTPUTS)


# ----------------------------------------------------------------------------- the stage

def load_target_config(name_or_path: str):
    """The target's (text) config, for its vocab size: the embedding rows, which may exceed the
    tokenizer's length (padded vocabularies)."""
    from .manifest import text_config
    from .target_layout import load_config

    try:
        config = load_config(name_or_path)
    except (OSError, ValueError) as e:
        raise PipelineError(f"cannot load the target config from {name_or_path!r}: "
                            f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    if not isinstance(getattr(text_config(config), "vocab_size", None), int):
        raise PipelineError(f"the target config of {name_or_path!r} has no vocab_size")
    return config


def counts_for(data_path: Path, out_dir: Path, key_of: Callable[[dict], dict], *, vocab_size: int,
               heldout_fraction: float, freq_from: Path | None = None, recount: bool = False,
               log=print, progress: Callable[[], object] | None = None) -> tuple[Counts, dict, str]:
    """Counts for this input: reused from a frequency file that provably matches it (input sha256
    and size, tokenizer, target vocab, split), else counted. Returns (counts, input, source), source
    being "counted", "reused" (this output's own file) or "copied from <file>" (--freq-from)."""
    from .manifest import describe_file

    def count() -> tuple[Counts, dict]:
        if progress is None:
            return count_tokens(data_path, vocab_size, heldout_fraction)
        with progress() as p:
            return count_tokens(data_path, vocab_size, heldout_fraction, progress=p)

    if recount or (freq_from is None and not (Path(out_dir) / FREQ_MANIFEST).exists()):
        return *count(), "counted"
    data = describe_file(data_path)
    source = Path(freq_from) if freq_from is not None else Path(out_dir)
    counts, why = load_counts(source, key_of(data))
    if counts is not None:
        log(f"reusing token counts from {source / FREQ} (input sha256 {data['sha256'][:12]} unchanged)")
        return counts, data, "reused" if freq_from is None else f"copied from {source / FREQ}"
    if freq_from is not None:
        raise PipelineError(f"--freq-from {freq_from} does not match this input: {why}")
    log(f"note: recounting tokens: {source / FREQ} is stale ({why})")
    counts, data2 = count()
    if data2["sha256"] != data["sha256"]:
        raise PipelineError(f"{data_path} changed while it was being read; rerun when it is final")
    return counts, data2, "counted"
