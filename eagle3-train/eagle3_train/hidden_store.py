"""The hidden-state store: what 02 writes and 04/05 read.

Layout of a store directory:
  shard-00000.safetensors   many samples, tokens concatenated:
      input_ids  int32 [N]          loss_mask  uint8 [N]
      aux        [N, n_aux, H]      the residual stream entering each auxiliary layer
      last       [N, H]             the final layer's output before the final norm
    (or, with compact storage, `aux_q` fp8 + `aux_scale` fp32 [N, n_aux], and/or
     `topk_ids` int32 [N, k] + `topk_logprobs` fp16 [N, k] instead of `last`)
    safetensors metadata: ids / offsets / lengths (JSON lists) of the samples in the shard.
  index.jsonl               one line per *committed* shard (appended after its atomic rename)
  plan.json                 which samples go to which shard (fixed at the first run)
  manifest.json             written last: the store counts as complete only then.

A shard is written to a temp file and renamed, then its index line is appended; a shard file
without an index line is a leftover of a kill and is redone.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .errors import PipelineError
from .manifest import read_manifest
from .store import TMP_PREFIX, JsonlWriter, _fsync_dir, read_jsonl

STAGE = "02_extract_hidden_states"
INDEX = "index.jsonl"
PLAN = "plan.json"

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def shard_name(k: int) -> str:
    return f"shard-{k:05d}.safetensors"


@dataclass
class SampleStates:
    """One sample's features, as 04 consumes them."""
    id: str
    input_ids: torch.Tensor  # int64 [T]
    loss_mask: torch.Tensor  # bool [T]
    aux: torch.Tensor  # [T, n_aux, H] in the stored/dequantised dtype
    last: torch.Tensor | None  # [T, H], None when the store keeps top-k instead
    topk_ids: torch.Tensor | None = None  # int64 [T, k]
    topk_logprobs: torch.Tensor | None = None  # float32 [T, k]


def write_shard(directory: Path, k: int, samples: Sequence[dict], tensors: dict[str, torch.Tensor]) -> dict:
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
    meta = {"ids": json.dumps([s["id"] for s in samples]), "offsets": json.dumps(offsets),
            "lengths": json.dumps(lengths)}
    final = directory / shard_name(k)
    tmp = directory / f"{TMP_PREFIX}{final.name}"
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(tmp), metadata=meta)
    with open(tmp, "rb+") as f:
        import os

        os.fsync(f.fileno())
    tmp.replace(final)
    _fsync_dir(directory)
    entry = {"shard": final.name, "k": k, "ids": [s["id"] for s in samples], "offsets": offsets,
             "lengths": lengths, "tokens": total, "bytes": final.stat().st_size}
    with JsonlWriter(directory / INDEX) as w:
        w.write(entry)
    return entry


def committed_shards(directory: Path) -> dict[int, dict]:
    """Index entries of shards that finished (last entry wins if a shard was redone)."""
    return {e["k"]: e for e in read_jsonl(Path(directory) / INDEX)}


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
        self._open: dict[str, object] = {}

    @property
    def layer_ids(self) -> list[int]:
        return list(self.manifest["layer_ids"])

    @property
    def hidden_size(self) -> int:
        return int(self.manifest["hidden_size"])

    def __len__(self) -> int:
        return len(self.ids)

    def length(self, sid: str) -> int:
        return self._where[sid][2]

    def _file(self, shard: str):
        if shard not in self._open:
            path = self.directory / shard
            if not path.exists():
                raise PipelineError(f"{path} is listed in {INDEX} but missing; rerun 02 to redo it")
            self._open[shard] = safe_open(str(path), framework="pt")
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
            aux = (rows("aux_q").to(torch.float32) * rows("aux_scale").unsqueeze(-1)).to(self.dtype)
        last = rows("last").to(self.dtype) if "last" in keys else None
        topk_ids = rows("topk_ids").long() if "topk_ids" in keys else None
        topk_lp = rows("topk_logprobs").float() if "topk_logprobs" in keys else None
        return SampleStates(sid, rows("input_ids").long(), rows("loss_mask").bool(), aux, last,
                            topk_ids, topk_lp)
