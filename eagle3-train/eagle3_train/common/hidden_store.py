"""The hidden-state store: what 02 writes and 04/05 read.

Layout of a store directory:
  shard-00000.safetensors   many samples, tokens concatenated (N rows):
      input_ids  int32 [N]          loss_mask  uint8 [N]
      aux        [N, n_aux, H]      the residual stream entering each auxiliary layer
      last       [N, H]             the final layer's output before the final norm
    compact storage replaces them:
      fp8        aux_q / last_q float8_e4m3fn + aux_scale fp32 [N, n_aux] / last_scale fp32 [N]
                 (one scale per token and layer: x ~= q * scale)
      fp8-topk   aux_q + aux_scale as above, and instead of `last` the target's own next-token
                 distribution at each position: topk_ids int32 [N, k], topk_logprobs fp16 [N, k]
                 (log-softmax over the full vocabulary, descending; row t predicts token t+1)
    safetensors metadata `eagle3`: JSON {ids, offsets, lengths, storage, layer_ids}, so a shard
    describes itself.
  index*.jsonl              one line per *committed* shard, appended after its atomic rename
                            (index.jsonl for a single process, index.rank-R.jsonl per rank);
                            a `dropped` line (from --repair) uncommits a shard.
  plan.json                 which samples go to which shard, fixed at the first run
  manifest.json             written last: the store counts as complete only then.

A shard is written to a temp file and renamed, then its index line is appended; a shard file
without an index line is a leftover of a kill and is redone. The plan fixes shard membership
and order, and a shard's content depends only on its samples, so a resumed run produces the same
shard files as an uninterrupted one.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eagle3_train.common.config import EXTRACT
from eagle3_train.common.errors import PipelineError
from eagle3_train.common.formats import PLAIN_STORAGES, STORAGES
from eagle3_train.common.manifest import read_manifest
from eagle3_train.common.store import TMP_PREFIX, JsonlWriter, atomic_write_json, fsync_dir, read_jsonl

STAGE = EXTRACT
INDEX = "index.jsonl"
PLAN = "plan.json"
PLAN_VERSION = 1
SHARD_META = "eagle3"  # the safetensors metadata key holding the shard's JSON description

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# --storage choices: plain dtypes keep aux and last as they are; the compact ones quantise.
PLAIN = dict(zip(PLAIN_STORAGES, (torch.bfloat16, torch.float16, torch.float32), strict=True))
COMPACT_GOAL = 0.40  # a compact option must store at most this share of bf16's bytes per token
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
LOGPROB_FLOOR = -1e4  # fp16 holds it; keeps a vanishing probability finite


def shard_name(k: int) -> str:
    return f"shard-{k:05d}.safetensors"


def index_name(rank: int = 0, world_size: int = 1) -> str:
    return INDEX if world_size == 1 else f"index.rank-{rank:03d}.jsonl"


# ----------------------------------------------------------------------------- sizes

def bytes_per_token(storage: str, n_aux: int, hidden: int, topk: int = 0) -> int:
    """Bytes one token costs in a shard (tensor data; the header is per shard and tiny)."""
    ids_mask = 4 + 1
    if storage in PLAIN:
        return ids_mask + (n_aux + 1) * hidden * PLAIN[storage].itemsize
    if storage == "fp8":
        return ids_mask + (n_aux + 1) * (hidden + 4)
    if storage == "fp8-topk":
        if topk < 1:
            raise PipelineError("--storage fp8-topk needs --topk of at least 1")
        return ids_mask + n_aux * (hidden + 4) + topk * (4 + 2)
    raise PipelineError(f"unknown storage {storage!r}; choose one of {', '.join(STORAGES)}")


def describe_storage(storage: str, n_aux: int, hidden: int, topk: int = 0) -> dict:
    bpt = bytes_per_token(storage, n_aux, hidden, topk)
    out = {"format": storage, "bytes_per_token": bpt,
           "share_of_bf16": round(bpt / bytes_per_token("bf16", n_aux, hidden), 4)}
    if storage in PLAIN:
        out |= {"aux": str(PLAIN[storage]).removeprefix("torch."), "last": "hidden"}
    else:
        out |= {"aux": "float8_e4m3fn, fp32 scale per token and layer",
                "last": "hidden (fp8 + scale)" if storage == "fp8" else "topk"}
    if storage == "fp8-topk":
        out["topk"] = topk
    return out


# ----------------------------------------------------------------------------- encoding

def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (last dim) e4m3 with an fp32 scale, so each token's vector uses the full range."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1) / FP8_MAX).clamp(min=1e-30)
    q = (xf / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale.float().unsqueeze(-1)


def nonfinite(t: torch.Tensor) -> int:
    return int((~torch.isfinite(t.float())).sum()) if t.is_floating_point() else 0


def encode(storage: str, input_ids: torch.Tensor, loss_mask: torch.Tensor, aux: torch.Tensor,
           last: torch.Tensor | None = None, topk: tuple[torch.Tensor, torch.Tensor] | None = None
           ) -> dict[str, torch.Tensor]:
    """The tensors of one shard. `aux` [N, n_aux, H] and `last` [N, H] as computed; `topk`
    (ids [N, k], logprobs [N, k]) for fp8-topk."""
    out = {"input_ids": input_ids.to(torch.int32).cpu(), "loss_mask": loss_mask.to(torch.uint8).cpu()}
    if storage in PLAIN:
        out["aux"] = aux.to(PLAIN[storage]).cpu()
        out["last"] = last.to(PLAIN[storage]).cpu()
    elif storage in ("fp8", "fp8-topk"):
        out["aux_q"], out["aux_scale"] = (t.cpu() for t in quantize_fp8(aux))
        if storage == "fp8":
            out["last_q"], out["last_scale"] = (t.cpu() for t in quantize_fp8(last))
        else:
            ids, lp = topk
            out["topk_ids"] = ids.to(torch.int32).cpu()
            out["topk_logprobs"] = lp.float().clamp(min=LOGPROB_FLOOR).to(torch.float16).cpu()
    else:
        raise PipelineError(f"unknown storage {storage!r}; choose one of {', '.join(STORAGES)}")
    return out


# ----------------------------------------------------------------------------- shards + index

def write_shard(directory: Path, k: int, samples: Sequence[dict], tensors: dict[str, torch.Tensor],
                *, index: str = INDEX, meta: dict | None = None) -> dict:
    """Write shard k atomically and append its index line. `samples`: [{'id', 'length'}] in the
    order their tokens appear in `tensors`. Returns the index entry."""
    directory = Path(directory)
    lengths = [int(s["length"]) for s in samples]
    offsets = [0]
    for n in lengths[:-1]:
        offsets.append(offsets[-1] + n)
    total = sum(lengths)
    for name, t in tensors.items():
        if t.shape[0] != total:
            raise ValueError(f"shard {k}: tensor {name} has {t.shape[0]} rows, expected {total}")
    # One metadata key: safetensors keeps metadata in a hash map whose order varies per process,
    # and a resumed run must write byte-identical shards.
    header = {SHARD_META: json.dumps({"ids": [s["id"] for s in samples], "offsets": offsets,
                                      "lengths": lengths, **(meta or {})}, sort_keys=True)}
    final = directory / shard_name(k)
    tmp = directory / f"{TMP_PREFIX}{final.name}"
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(tmp), metadata=header)
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    tmp.replace(final)
    fsync_dir(directory)
    entry = {"shard": final.name, "k": k, "ids": [s["id"] for s in samples], "offsets": offsets,
             "lengths": lengths, "tokens": total, "bytes": final.stat().st_size,
             "seq": time.time_ns()}
    with JsonlWriter(directory / index) as w:
        w.write(entry)
    return entry


def _index_entries(directory: Path) -> list[dict]:
    entries = []
    for path in sorted(Path(directory).glob("index*.jsonl")):
        entries += list(read_jsonl(path))
    return sorted(entries, key=lambda e: e.get("seq", 0))


def committed_shards(directory: Path) -> dict[int, dict]:
    """Index entries of shards that finished (last entry wins; a `dropped` line uncommits)."""
    out: dict[int, dict] = {}
    for e in _index_entries(directory):
        if e.get("dropped"):
            out.pop(e["k"], None)
        else:
            out[e["k"]] = e
    return out


def drop_shards(directory: Path, ks: Sequence[int], *, index: str = INDEX) -> None:
    """Uncommit shards (append-only): their files are moved aside so the next run redoes them."""
    directory = Path(directory)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    with JsonlWriter(directory / index) as w:
        for k in ks:
            path = directory / shard_name(k)
            if path.exists():
                path.replace(directory / f"bad-{stamp}-{path.name}")
            w.write({"k": k, "shard": shard_name(k), "dropped": True, "seq": time.time_ns()})


# ----------------------------------------------------------------------------- plan

def make_plan(samples: Sequence[tuple[str, int]], shard_tokens: int) -> list[dict]:
    """Longest samples first (so an out-of-memory shows up in the first minutes, and batches of
    similar lengths waste little padding), cut into shards of at most `shard_tokens` tokens."""
    order = sorted(range(len(samples)), key=lambda i: (-samples[i][1], i))
    shards, cur, cur_tokens = [], [], 0
    for i in order:
        sid, n = samples[i]
        if cur and cur_tokens + n > shard_tokens:
            shards.append({"k": len(shards), "ids": cur, "tokens": cur_tokens})
            cur, cur_tokens = [], 0
        cur.append(sid)
        cur_tokens += n
    if cur:
        shards.append({"k": len(shards), "ids": cur, "tokens": cur_tokens})
    return shards


def load_or_create_plan(directory: Path, make: Callable[[], list[dict]]) -> dict:
    """The plan made at the first run, read back on every resume. Whether a rerun may resume (the
    same input, target, layers and storage) is rerun.py's question, asked before this."""
    path = Path(directory) / PLAN
    if path.exists():
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise PipelineError(f"{path} is not valid JSON ({e.msg}); pass --overwrite to start over") from None
    shards = make()
    plan = {"version": PLAN_VERSION, "shards": shards,
            "samples": sum(len(s["ids"]) for s in shards), "tokens": sum(s["tokens"] for s in shards)}
    atomic_write_json(path, plan)
    return plan


# ----------------------------------------------------------------------------- reader

@dataclass
class SampleStates:
    """One sample's features, as 04 consumes them."""
    id: str
    input_ids: torch.Tensor  # int64 [T]
    loss_mask: torch.Tensor  # bool [T]
    aux: torch.Tensor  # [T, n_aux, H] in the stored/dequantised dtype
    last: torch.Tensor | None  # [T, H], None when the store keeps top-k instead
    topk_ids: torch.Tensor | None = None  # int64 [T, k]: row t = target's top-k for token t+1
    topk_logprobs: torch.Tensor | None = None  # float32 [T, k], log-softmax over the full vocab


MAX_OPEN_SHARDS = 64


class HiddenStates:
    """Read a complete store: `hs = HiddenStates(dir); hs.ids; hs.get(id)`."""

    def __init__(self, directory: Path, *, dtype: torch.dtype = torch.float32):
        self.directory = Path(directory)
        self.manifest = read_manifest(self.directory, STAGE)
        self.dtype = dtype
        self._where: dict[str, tuple[str, int, int]] = {}
        for e in committed_shards(self.directory).values():
            for sid, off, n in zip(e["ids"], e["offsets"], e["lengths"]):
                self._where[sid] = (e["shard"], off, n)
        self.ids = list(self._where)
        # Shuffled reads over thousands of shards would exhaust file descriptors: keep an LRU.
        self._open: OrderedDict[str, object] = OrderedDict()

    @property
    def layer_ids(self) -> list[int]:
        return list(self.manifest["layer_ids"])

    @property
    def hidden_size(self) -> int:
        return int(self.manifest["hidden_size"])

    @property
    def storage(self) -> dict:
        """{'format': 'bf16'|'fp16'|'fp32'|'fp8'|'fp8-topk', 'last': 'hidden'|'topk', ...}."""
        return dict(self.manifest.get("storage") or {"format": "bf16"})

    @property
    def has_last(self) -> bool:
        """False when the store keeps the target's top-k instead of the last hidden state."""
        st = self.storage
        return st.get("last", "hidden") != "topk" and st.get("format") != "fp8-topk"

    def __len__(self) -> int:
        return len(self.ids)

    def length(self, sid: str) -> int:
        return self._where[sid][2]

    def shard_of(self, sid: str) -> str:
        return self._where.get(sid, ("?",))[0]

    def _file(self, shard: str):
        if shard in self._open:
            self._open.move_to_end(shard)
        else:
            while len(self._open) >= MAX_OPEN_SHARDS:
                self._open.popitem(last=False)
            path = self.directory / shard
            if not path.exists():
                raise PipelineError(f"{path} is listed in the index but missing; rerun 02 with --repair")
            try:
                self._open[shard] = safe_open(str(path), framework="pt")
            except Exception as e:
                raise PipelineError(f"{path} is unreadable ({type(e).__name__}); "
                                    "rerun 02 with --repair to redo it") from None
        return self._open[shard]

    def get(self, sid: str) -> SampleStates:
        try:
            shard, off, n = self._where[sid]
        except KeyError:
            raise PipelineError(f"sample {sid!r} is not in {self.directory}") from None
        f = self._file(shard)
        keys = set(f.keys())

        def rows(name):
            return f.get_slice(name)[off: off + n]

        if "aux" in keys:
            aux = rows("aux").to(self.dtype)
        else:  # fp8 with a scale per token and layer
            aux = dequantize_fp8(rows("aux_q"), rows("aux_scale")).to(self.dtype)
        if "last" in keys:
            last = rows("last").to(self.dtype)
        elif "last_q" in keys:
            last = dequantize_fp8(rows("last_q"), rows("last_scale")).to(self.dtype)
        else:
            last = None
        topk_ids = rows("topk_ids").long() if "topk_ids" in keys else None
        topk_lp = rows("topk_logprobs").float() if "topk_logprobs" in keys else None
        return SampleStates(sid, rows("input_ids").long(), rows("loss_mask").bool(), aux, last,
                            topk_ids, topk_lp)


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TB"


def shard_tokens_for(shard_mb: float, bpt: int) -> int:
    return max(1, math.floor(shard_mb * 1024 * 1024 / bpt))


# ----------------------------------------------------------------------------- a store still being written
# 04 --follow trains on a store while its producer (02, or 01b's capture mode) writes it. The producer
# writes HEADER before its first shard: what the manifest will say about the store's format, so a
# follower checks the store belongs with its other inputs before the manifest exists. The producer
# holds the store's shard bytes under a bound (wait_for_room) while the follower deletes the shards
# it has trained (04 --consume).

HEADER = "header.json"
HEADER_KEYS = ("target", "tokenizer", "layer_ids", "aux_layer_ids", "last_layer_id", "hidden_size", "storage",
               "dtype")


def read_header(directory: Path) -> dict | None:
    """The store's format: its manifest once complete, else the producer's HEADER; None when neither
    is there yet."""
    directory = Path(directory)
    if (directory / "manifest.json").exists():
        return read_manifest(directory, STAGE)
    path = directory / HEADER
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise PipelineError(f"{path} is not valid JSON ({e.msg}); rerun the producer (02) to rewrite it") from None


def store_bytes(directory: Path) -> int:
    """Bytes of the store's shard files on disk, committed or being written (the producer's bound)."""
    total = 0
    for p in Path(directory).iterdir():
        name = p.name.removeprefix(TMP_PREFIX)
        if name.startswith("shard-") and name.endswith(".safetensors"):
            try:
                total += p.stat().st_size
            except FileNotFoundError:  # consumed (or renamed) meanwhile
                pass
    return total


def request_bytes(directory: Path | None) -> int:
    """Bytes of the files in a vLLM connector's directory (01b capture's answers in flight: states the
    server wrote, not yet read into a shard); 0 when there is none."""
    total = 0
    try:
        entries = list(Path(directory).iterdir()) if directory is not None else []
    except FileNotFoundError:
        return 0
    for p in entries:
        try:
            total += p.stat().st_size
        except FileNotFoundError:  # read and deleted meanwhile
            pass
    return total


def note(log_path: Path | None, stage: str, text: str) -> None:
    """One line on stdout and in progress.log (the waits of a producer and a follower)."""
    import datetime as dt

    print(f"{stage}: {text}", flush=True)
    if log_path is not None and Path(log_path).parent.is_dir():
        now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        with open(log_path, "a") as f:
            f.write(f"{now} {stage} {text}\n")


def wait_for_room(directory: Path, limit: int, ahead: int, *, log_path: Path | None, stage: str,
                  every_s: float = 30.0, poll_s: float = 0.5, in_flight: Callable[[], int] | None = None) -> float:
    """Back-pressure: return once the shard bytes on disk plus `ahead` (estimated bytes computed but
    not yet on disk) plus `in_flight()` (bytes on disk outside the store that become part of it, e.g.
    request_bytes of 01b capture's connector directory; measured again at every poll) are within
    `limit`, so the store never holds more than `limit` plus the shard about to be made. Returns the
    seconds waited (the wait shows in progress.log)."""
    t0 = last = time.monotonic()
    said = False
    while (used := store_bytes(directory)) + (flying := ahead + (in_flight() if in_flight else 0)) > limit:
        now = time.monotonic()
        if not said or now - last >= every_s:
            note(log_path, stage, f"waiting for room: store {human_bytes(used)} + {human_bytes(flying)} in flight "
                                  f"> --max-store-gb {limit / 1e9:g} GB; resumes as 04 --follow --consume trains "
                                  "and deletes shards")
            said, last = True, now
        time.sleep(poll_s)
    waited = time.monotonic() - t0
    if said:
        note(log_path, stage, f"room again after {waited:.0f} s: store {human_bytes(used)}")
    return waited


class GrowingStore(HiddenStates):
    """A store still being written, for 04 --follow: its format from read_header, its samples those of
    the shards `add`ed so far (each by its index entry; a shard may live in another directory, like
    04's copies of held-out samples), and `forget` closing a shard before it is deleted. The LRU of
    open shards is shared by the training loader thread and the main thread: a lock guards it."""

    def __init__(self, directory: Path, header: dict, *, dtype: torch.dtype = torch.float32):
        import threading

        self.directory = Path(directory)
        self.manifest = header
        self.dtype = dtype
        self._where = {}
        self.ids = []
        self._open = OrderedDict()
        self._lock = threading.Lock()

    def add(self, entry: dict, directory: Path | None = None, only: set | None = None) -> None:
        path = str(Path(directory or self.directory) / entry["shard"])
        for sid, off, n in zip(entry["ids"], entry["offsets"], entry["lengths"]):
            if only is None or sid in only:
                if sid not in self._where:
                    self.ids.append(sid)
                self._where[sid] = (path, off, n)

    def forget(self, path: str) -> None:
        with self._lock:  # a deleted file stays on disk while it is open (mapped)
            self._open.pop(str(path), None)

    def _file(self, shard: str):
        with self._lock:
            return super()._file(shard)
