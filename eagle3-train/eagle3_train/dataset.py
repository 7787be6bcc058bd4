"""The tokenized training set: raw responses -> `data.jsonl` of {id, input_ids, loss_mask, stats}.

Written by `01b --tokenize` / `01c_tokenize.py`, read by 02 and 03. Every record goes through
`tokenization.tokenize_sample`; this module only decides what to keep and counts what it drops.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path

from .errors import PipelineError
from .manifest import read_manifest
from .store import read_jsonl

STAGE = "tokenize"
DATA = "data.jsonl"


def training_record(sample: dict, tok) -> dict:
    """The stored form of one tokenized sample (`tok` is a tokenization.Tokenized)."""
    return {
        "id": sample["id"],
        "input_ids": tok.input_ids,
        "loss_mask": tok.loss_mask,
        "stats": {"prompt_len": tok.prompt_len, "num_supervised": tok.num_supervised,
                  "num_truncated": tok.num_truncated, "source": tok.source,
                  "mismatch": tok.mismatch, "finish_reason": sample.get("finish_reason")},
    }


class TrainingSet:
    """A complete tokenized set: `ts = TrainingSet(dir); ts.manifest; for rec in ts: ...`."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self.manifest = read_manifest(self.directory, STAGE)
        self.path = self.directory / DATA
        if not self.path.exists():
            raise PipelineError(f"{self.path} is missing although its manifest says complete")

    @property
    def tokenizer(self) -> dict:
        return self.manifest["tokenizer"]

    def __iter__(self) -> Iterator[dict]:
        for rec in read_jsonl(self.path, tolerate_torn_tail=False):
            for key in ("id", "input_ids", "loss_mask"):
                if key not in rec:
                    raise PipelineError(f"{self.path}: record {rec.get('id', '?')} has no {key!r}")
            if len(rec["input_ids"]) != len(rec["loss_mask"]):
                raise PipelineError(f"{self.path}: record {rec['id']} has {len(rec['input_ids'])} "
                                    f"input_ids but {len(rec['loss_mask'])} loss_mask entries")
            yield rec


def summarize(records: Iterable[dict]) -> dict:
    n, tokens, supervised, truncated, mismatched = 0, 0, 0, 0, 0
    sources = Counter()
    for rec in records:
        n += 1
        tokens += len(rec["input_ids"])
        supervised += sum(rec["loss_mask"])
        st = rec.get("stats", {})
        truncated += bool(st.get("num_truncated"))
        mismatched += bool(st.get("mismatch"))
        sources[st.get("source", "?")] += 1
    return {"samples": n, "tokens": tokens, "supervised_tokens": supervised,
            "samples_truncated": truncated, "samples_mismatched": mismatched, "sources": dict(sources)}
