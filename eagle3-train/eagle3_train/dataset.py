"""The tokenized training set: raw responses -> `data.jsonl` of {id, input_ids, loss_mask, stats}.

Written by `01b --tokenize` / `01c_tokenize.py`, read by 02 and 03. Every record goes through
`tokenization.tokenize_sample`; this module only decides what to keep and counts what it drops.
"""

from __future__ import annotations

import os
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


# ----------------------------------------------------------------------------- the tokenize step

RAW_STAGE = "01b"
RAW_FILE = "raw_responses.jsonl"
MISMATCH_EXAMPLES = 5  # mismatches of each kind described in full in the manifest; all are counted


def _window(fmt, ids: list[int], at: int, width: int = 6) -> str:
    return fmt.tokenizer.decode(ids[max(0, at - width): at + width], skip_special_tokens=False)


def describe_mismatch(sample: dict, tok, fmt) -> dict:
    """Where the returned ids and the re-wrapped text part ways, decoded on both sides."""
    from .tokenization import MISMATCH_CAUSES, tokenize_sample

    text_only = tokenize_sample({**sample, "prompt_token_ids": None, "token_ids": None}, fmt)
    at = tok.mismatch["first"]
    return {"id": sample["id"], **tok.mismatch, "cause": MISMATCH_CAUSES[tok.mismatch["kind"]],
            "in_prompt": at < tok.prompt_len,
            "ids_side": _window(fmt, tok.input_ids, at), "text_side": _window(fmt, text_only.input_ids, at)}


def is_empty_answer(sample: dict) -> bool:
    """Neither reasoning nor content has any text: the sample would teach only the closing tokens
    (`</think><|im_end|>`), so it is dropped and counted rather than trained on. A record with only
    token ids (no texts) is never called empty here."""
    texts = [sample.get(k) for k in ("reasoning", "content")]
    if all(t is None for t in texts):
        return False
    return not any(isinstance(t, str) and t.strip() for t in texts)


def build_training_set(raw_dir: Path, out_dir: Path, fmt, *, tokenizer_name: str,
                       max_seq_len: int | None = None, loss_on: str = "final", keep_length: bool = True,
                       progress_every: float = 30.0, log=print) -> dict:
    """raw_responses.jsonl of a complete 01b run -> `out_dir/data.jsonl` + manifest (stage tokenize).

    Every sample goes through tokenization.tokenize_sample (path (a), the returned ids, when
    present; checked against path (b), the re-wrapped text). Mismatches are kept and reported;
    answers cut by max_tokens are kept unless keep_length=False; empty answers and samples left with
    no supervised token (e.g. a prompt longer than max_seq_len) are dropped. Everything is counted in
    the manifest.
    Rebuilt from scratch each time (temp file + rename), skipped when already up to date.
    """
    from .manifest import MANIFEST, describe_file, describe_tokenizer, write_manifest
    from .progress import Progress
    from .store import DirLock, JsonlWriter, TMP_PREFIX, clean_temp_files, file_sha256, json_sha256
    from .tokenization import tokenize_sample

    raw_dir, out_dir = Path(raw_dir), Path(out_dir)
    raw_manifest = read_manifest(raw_dir, RAW_STAGE)
    raw_path = raw_dir / RAW_FILE
    if not raw_path.exists():
        raise PipelineError(f"{raw_path} is missing although its manifest says complete")
    raw_sha = file_sha256(raw_path)
    tok_desc = describe_tokenizer(fmt.tokenizer, tokenizer_name)
    config = {"max_seq_len": max_seq_len, "loss_on": loss_on, "keep_length": keep_length}
    key = json_sha256({"raw": raw_sha, "tokenizer": tok_desc["fingerprint"], "format": fmt.describe(),
                       "config": config})
    with DirLock(out_dir, STAGE):
        try:
            old = read_manifest(out_dir, STAGE)
        except PipelineError:
            old = None
        if old and old.get("build_key") == key and (out_dir / DATA).exists():
            log(f"tokenize: {out_dir / DATA} is up to date ({old['counts'].get('samples')} samples)")
            return old
        clean_temp_files(out_dir)
        (out_dir / MANIFEST).unlink(missing_ok=True)
        tmp = out_dir / f"{TMP_PREFIX}{DATA}"
        counts = Counter()
        finish = Counter()
        kinds = Counter()
        mismatches: list[dict] = []
        kept: list[dict] = []  # stand-ins for summarize(): it only takes lengths and sums
        seen: set[str] = set()
        total = raw_manifest.get("counts", {}).get("records_in_file") or 0
        progress = Progress("tokenize", total, log_path=out_dir / "progress.log", every_s=progress_every,
                            unit="sample")
        try:
            with JsonlWriter(tmp, fsync=False) as w:
                for sample in read_jsonl(raw_path):
                    progress.update(1)
                    counts["input_records"] += 1
                    sid = sample.get("id")
                    if sid in seen:
                        counts["dropped_duplicate_id"] += 1
                        continue
                    seen.add(sid)
                    fr = sample.get("finish_reason")
                    finish[fr] += 1
                    if fr == "length" and not keep_length:
                        counts["dropped_length"] += 1
                        continue
                    if is_empty_answer(sample):
                        counts["dropped_empty_answer"] += 1
                        continue
                    t = tokenize_sample(sample, fmt, max_seq_len=max_seq_len, loss_on=loss_on)
                    if t.mismatch is not None:
                        counts["mismatched"] += 1
                        kinds[t.mismatch["kind"]] += 1
                        if kinds[t.mismatch["kind"]] <= MISMATCH_EXAMPLES:
                            mismatches.append(describe_mismatch(sample, t, fmt))
                    counts["text_derived"] += t.source == "text"
                    if t.num_truncated:
                        counts["truncated"] += 1
                    if t.num_supervised == 0:
                        counts["dropped_no_supervised_tokens"] += 1
                        continue
                    if fr == "length":
                        counts["kept_length"] += 1
                    rec = training_record(sample, t)
                    w.write(rec)
                    kept.append({"input_ids": range(len(t.input_ids)), "loss_mask": [t.num_supervised],
                                 "stats": rec["stats"]})
            if not kept:
                raise PipelineError(f"{raw_path}: no sample left after tokenization ({dict(counts)})")
            os.replace(tmp, out_dir / DATA)
        finally:
            progress.close()
            if tmp.exists():
                tmp.unlink()
        summary = summarize(kept)
        all_counts = {**summary, **{k: counts[k] for k in (
            "input_records", "mismatched", "truncated", "kept_length", "dropped_length",
            "dropped_no_supervised_tokens", "dropped_empty_answer", "dropped_duplicate_id", "text_derived")},
            "mismatch_kinds": dict(kinds), "finish_reasons": dict(finish)}
        from .tokenization import MISMATCH_CAUSES
        manifest = write_manifest(
            out_dir, STAGE, config=config,
            inputs={"raw_responses": {**describe_file(raw_path, hash_it=False), "sha256": raw_sha},
                    "raw_manifest": {"created": raw_manifest.get("created"),
                                     "model": raw_manifest.get("target", {}).get("model")}},
            outputs={"data": describe_file(out_dir / DATA, hash_it=False)}, counts=all_counts,
            tokenizer=tok_desc, chat_format=fmt.describe(), mismatch_examples=mismatches,
            mismatch_causes={k: MISMATCH_CAUSES[k] for k in kinds},
            text_derived=bool(counts["text_derived"] or raw_manifest.get("text_derived")), build_key=key)
    log(format_summary(all_counts, mismatches, out_dir / DATA))
    return manifest


def format_summary(c: dict, mismatches: list[dict], path: Path) -> str:
    from .tokenization import BOUNDARY_WHITESPACE, MISMATCH_CAUSES, REAL

    kinds = c.get("mismatch_kinds", {})
    lines = [f"tokenize: {c['samples']} samples ({c['tokens']} tokens, {c['supervised_tokens']} supervised) "
             f"-> {path}",
             f"  from {c['input_records']} answers: mismatched {c['mismatched']} (returned ids vs "
             f"re-wrapped text: {kinds.get(REAL, 0)} real, {kinds.get(BOUNDARY_WHITESPACE, 0)} boundary "
             f"whitespace), truncated {c['truncated']}, kept cut-by-length {c['kept_length']}; "
             f"dropped: length {c['dropped_length']}, no supervised tokens "
             f"{c['dropped_no_supervised_tokens']}, empty answer {c['dropped_empty_answer']}, "
             f"duplicate id {c['dropped_duplicate_id']}"]
    if kinds.get(BOUNDARY_WHITESPACE):
        lines.append(f"  {kinds[BOUNDARY_WHITESPACE]} boundary-whitespace mismatches, expected: "
                     f"{MISMATCH_CAUSES[BOUNDARY_WHITESPACE]}")
    if kinds.get(REAL):
        lines.append(f"warning: {kinds[REAL]} real mismatches: {MISMATCH_CAUSES[REAL]}")
    if c.get("text_derived"):
        lines.append(f"warning: {c['text_derived']} samples are text-derived (ids re-wrapped from "
                     "reasoning/content, not returned by the server)")
    # Real mismatches first: they are the ones to read.
    for m in sorted(mismatches, key=lambda m: m.get("kind") != REAL):
        lines.append(f"  mismatch {m['id']} ({m.get('kind')}): {m['count']} positions differ from "
                     f"{m['first']} ({'prompt' if m['in_prompt'] else 'answer'}): ids {m['ids_side']!r} vs "
                     f"text {m['text_side']!r}")
    return "\n".join(lines)
