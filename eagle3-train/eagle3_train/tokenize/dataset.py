"""The tokenized training set: raw responses -> `data.jsonl` of {id, input_ids, loss_mask, stats}.

Written by `01b --tokenize` / `01c_tokenize.py`, read by 02 and 03. Every record goes through
`tokenization.tokenize_sample`; this module only decides what to keep and counts what it drops.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path

from eagle3_train.common.config import GENERATE, TOKENIZE
from eagle3_train.common.errors import PipelineError
from eagle3_train.common.manifest import read_manifest
from eagle3_train.common.store import Line, jsonl_lines, parse_json_line, read_jsonl
from eagle3_train.common.layout import RAW
from eagle3_train.tokenize.report import Tally, report_lines, summary_by_kind

STAGE = TOKENIZE
DATA = "data.jsonl"


def training_record(sample: dict, tok) -> dict:
    """The stored form of one tokenized sample (`tok` is a tokenization.Tokenized)."""
    return {
        "id": sample["id"],
        "input_ids": tok.input_ids,
        "loss_mask": tok.loss_mask,
        "stats": {"prompt_len": tok.prompt_len, "num_supervised": tok.num_supervised,
                  "num_truncated": tok.num_truncated, "source": tok.source,
                  "mismatch": tok.mismatch, "malformed": tok.malformed,
                  "finish_reason": sample.get("finish_reason")},
    }


def check_record(rec: dict, where: str) -> dict:
    """A tokenized record has an id and as many loss_mask entries as input_ids (one place says so)."""
    for key in ("id", "input_ids", "loss_mask"):
        if key not in rec:
            raise PipelineError(f"{where}: record {rec.get('id', '?')} has no {key!r}")
    ids, mask = rec["input_ids"], rec["loss_mask"]
    if not isinstance(ids, list) or not isinstance(mask, list):
        raise PipelineError(f"{where}: record {rec['id']}: input_ids and loss_mask must be lists")
    if len(ids) != len(mask):
        raise PipelineError(f"{where}: record {rec['id']} has {len(ids)} input_ids but {len(mask)} "
                            "loss_mask entries")
    return rec


class TrainingSet:
    """A complete tokenized set, the one reader of data.jsonl (02, 03 and the tests read it here):
    `ts = TrainingSet(dir); ts.manifest; for rec in ts: ...`; `ts.lines(digest=h)` for offsets
    and a hash of exactly the bytes read; `ts.records_at(offsets)` for random access."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self.manifest = read_manifest(self.directory, STAGE)
        self.path = self.directory / DATA
        if not self.path.exists():
            raise PipelineError(f"{self.path} is missing although its manifest says complete")

    @property
    def tokenizer(self) -> dict:
        return self.manifest.get("tokenizer") or {}

    def lines(self, *, digest=None) -> Iterator[Line]:
        """Every record, checked, with its line number and byte offset (no torn tail tolerated:
        a complete set was renamed into place whole)."""
        for line in jsonl_lines(self.path, tolerate_torn_tail=False, digest=digest):
            check_record(line.record, f"{self.path}:{line.lineno}")
            yield line

    def __iter__(self) -> Iterator[dict]:
        for line in self.lines():
            yield line.record

    def records_at(self, offsets: Iterable[int]) -> list[dict]:
        """The records starting at these byte offsets (from lines()), checked, in that order."""
        out = []
        with open(self.path, "rb") as f:
            for offset in offsets:
                f.seek(offset)
                where = f"{self.path} (offset {offset})"
                out.append(check_record(parse_json_line(f.readline(), where), where))
        return out


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

RAW_STAGE = GENERATE


def is_empty_answer(sample: dict) -> bool:
    """Neither reasoning nor content has any text: the sample would teach only the closing tokens
    (`</think><|im_end|>`), so it is dropped and counted rather than trained on. A record with only
    token ids (no texts) is never called empty here."""
    texts = [sample.get(k) for k in ("reasoning", "content")]
    if all(t is None for t in texts):
        return False
    return not any(isinstance(t, str) and t.strip() for t in texts)


def training_sequence(sample: dict, fmt, *, max_seq_len: int | None, loss_on: str,
                      keep_length: bool) -> tuple[object | None, str | None]:
    """01c's rule for one answer, in one place (01c and 01b's capture both follow it): its
    tokenization.Tokenized (None if never tokenized) and, when 01c drops it, the count it drops
    under ('dropped_length', 'dropped_empty_answer', 'dropped_no_supervised_tokens')."""
    from eagle3_train.common.tokenization import tokenize_sample

    if sample.get("finish_reason") == "length" and not keep_length:
        return None, "dropped_length"
    if is_empty_answer(sample):
        return None, "dropped_empty_answer"
    t = tokenize_sample(sample, fmt, max_seq_len=max_seq_len, loss_on=loss_on)
    return t, None if t.num_supervised else "dropped_no_supervised_tokens"


def check_raw_file(raw_path: Path, raw_manifest: dict, sha256: str) -> None:
    """The raw file is what its finished stage wrote: its size and hash are the ones the manifest
    recorded (manifest.describe_file). A torn last line, an appended or edited record after that
    would otherwise be read quietly (a torn tail is skipped), so it is refused in one line."""
    recorded = (raw_manifest.get("outputs") or {}).get("raw_responses") or {}
    if not recorded:  # a manifest that describes no file (hand-made): nothing to hold it to
        return
    size = raw_path.stat().st_size
    same = recorded.get("size") in (None, size) and recorded.get("sha256") in (None, sha256)
    if same:
        return
    n = (raw_manifest.get("counts") or {}).get("records_in_file")
    records = f"{n} records, " if n is not None else ""
    old_sha = str(recorded.get("sha256") or "?")[:12]
    writer = raw_manifest.get("written_by") or raw_manifest.get("stage") or RAW_STAGE
    writer = writer.split("_")[0]  # 01a or 01b
    raise PipelineError(f"{raw_path} does not match its manifest ({records}{recorded.get('size')} bytes, sha256 "
                        f"{old_sha}...; the file now has {size} bytes, sha256 {sha256[:12]}...): it changed "
                        f"after {writer} finished; rerun {writer} to repair it")


def longest_prompt(raw_manifest: dict, raw_path: Path) -> int | None:
    """Tokens of the longest prompt among the raw answers: 01b's manifest says it; an older one
    does not, so the file is read for it (prompt ids only)."""
    counts = raw_manifest.get("counts") or {}
    if counts.get("longest_prompt_tokens") is not None:
        return counts["longest_prompt_tokens"]
    return max((len(r.get("prompt_token_ids") or ()) for r in read_jsonl(raw_path)), default=None)


def server_context(raw_manifest: dict) -> int | None:
    """The smallest max_model_len 01b's servers reported at its start (its KV-cache preflight), if any."""
    endpoints = (((raw_manifest.get("this_run") or {}).get("server_cache") or {}).get("endpoints") or {})
    lens = [e["max_model_len"] for e in endpoints.values() if isinstance(e, dict) and e.get("max_model_len")]
    return min(lens) if lens else None


def build_training_set(raw_dir: Path, out_dir: Path, fmt, *, tokenizer_name: str,
                       max_seq_len: int | None = None, loss_on: str = "final", keep_length: bool = True,
                       progress_every: float = 30.0, log=print) -> dict:
    """raw_responses.jsonl of a complete 01b run -> `out_dir/data.jsonl` + manifest (stage tokenize).

    Every sample goes through tokenization.tokenize_sample (path (a), the returned ids, when
    present; checked against path (b), the re-wrapped text). Mismatches are kept and reported;
    answers cut by max_tokens are kept unless keep_length=False; empty answers and samples left with
    no supervised token (e.g. a prompt longer than max_seq_len) are dropped. Everything is counted in
    the manifest. max_seq_len None: tokenize/config.py:resolve_max_seq_len against 01b's manifest
    (the longest prompt + its --max-tokens, ...), recorded resolved with where it came from.
    Rebuilt from scratch each time (temp file + rename), skipped when already up to date.
    """
    from eagle3_train.common.manifest import MANIFEST, describe_file, describe_tokenizer, write_manifest
    from eagle3_train.common.progress import Progress
    from eagle3_train.common.store import TMP_PREFIX, DirLock, JsonlWriter, clean_temp_files, file_sha256, json_sha256
    from eagle3_train.tokenize.config import resolve_max_seq_len, shortfall_warning

    raw_dir, out_dir = Path(raw_dir), Path(out_dir)
    raw_manifest = read_manifest(raw_dir, RAW_STAGE)
    raw_path = raw_dir / RAW
    if not raw_path.exists():
        raise PipelineError(f"{raw_path} is missing although its manifest says complete")
    raw_sha = file_sha256(raw_path)
    check_raw_file(raw_path, raw_manifest, raw_sha)
    tok_desc = describe_tokenizer(fmt.tokenizer, tokenizer_name)
    max_tokens = (raw_manifest.get("config") or {}).get("max_tokens")
    longest = longest_prompt(raw_manifest, raw_path) if max_tokens else None
    with DirLock(out_dir, STAGE):
        try:
            old = read_manifest(out_dir, STAGE)
        except PipelineError:
            old = None
        # a set built before --max-seq-len had a resolved default keeps its value on a bare rerun
        was = (old or {}).get("config") or {}
        recorded = was.get("max_seq_len") if was and "max_seq_len_from" not in was else None
        max_seq_len, source, note = resolve_max_seq_len(max_seq_len, longest_prompt=longest, max_tokens=max_tokens,
                                                        max_model_len=server_context(raw_manifest), recorded=recorded)
        if note:
            log(note)
        config = {"max_seq_len": max_seq_len, "loss_on": loss_on, "keep_length": keep_length}
        key = json_sha256({"raw": raw_sha, "tokenizer": tok_desc["fingerprint"], "format": fmt.describe(),
                           "config": config})
        if old and old.get("build_key") == key and (out_dir / DATA).exists():
            log(f"tokenize: {out_dir / DATA} is up to date ({old['counts'].get('samples')} samples)")
            return old
        clean_temp_files(out_dir)
        (out_dir / MANIFEST).unlink(missing_ok=True)
        tmp = out_dir / f"{TMP_PREFIX}{DATA}"
        counts = Counter()
        finish = Counter()
        malformed = Counter()  # an answer-quality figure: what the model left malformed, by reason
        mismatches = Tally()
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
                    t, dropped = training_sequence(sample, fmt, max_seq_len=max_seq_len, loss_on=loss_on,
                                                   keep_length=keep_length)
                    if t is None:
                        counts[dropped] += 1
                        continue
                    if t.malformed:
                        malformed[t.malformed] += 1
                    if t.mismatch is not None:
                        counts["mismatched"] += 1
                        mismatches.add(sample, t, fmt)
                    counts["text_derived"] += t.source == "text"
                    if t.num_truncated:
                        counts["truncated"] += 1
                    if dropped:
                        counts[dropped] += 1
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
            "mismatch_kinds": dict(mismatches.kinds), "finish_reasons": dict(finish),
            "malformed": sum(malformed.values()), "malformed_reasons": dict(malformed)}
        manifest = write_manifest(
            out_dir, STAGE, config={**config, "max_seq_len_from": source},
            inputs={"raw_responses": {**describe_file(raw_path, hash_it=False), "sha256": raw_sha},
                    "raw_manifest": {"created": raw_manifest.get("created"),
                                     "model": raw_manifest.get("target", {}).get("model")}},
            outputs={"data": describe_file(out_dir / DATA, hash_it=False)}, counts=all_counts,
            tokenizer=tok_desc, chat_format=fmt.describe(), **mismatches.manifest_fields(),
            text_derived=bool(counts["text_derived"] or raw_manifest.get("text_derived")), build_key=key)
    log(format_summary(all_counts, mismatches.examples, out_dir / DATA))
    short = shortfall_warning(max_seq_len, longest_prompt=longest, max_tokens=max_tokens, cut=counts["truncated"],
                              dropped=counts["dropped_no_supervised_tokens"], answers=counts["input_records"])
    if short:
        log(short)
    return manifest


def run(cfg) -> dict:
    """01c for a TokenizeConfig: render with the template kwargs and the tokenizer 01b recorded,
    unless told otherwise, then build_training_set."""
    from dataclasses import replace

    from eagle3_train.common.tokenization import chat_format_from_args

    recorded = read_manifest(cfg.raw_dir, RAW_STAGE).get("config", {})
    if not cfg.chat_template_kwargs and recorded.get("chat_template_kwargs"):
        cfg = replace(cfg, chat_template_kwargs=recorded["chat_template_kwargs"])
    name = cfg.tokenizer or recorded.get("tokenizer") or recorded.get("model")
    fmt = chat_format_from_args(cfg, default_tokenizer=name)
    return build_training_set(cfg.raw_dir, cfg.output_dir, fmt, tokenizer_name=name, max_seq_len=cfg.max_seq_len,
                              loss_on=cfg.loss_on, keep_length=cfg.keep_length, progress_every=cfg.progress_every)


def format_summary(c: dict, mismatches: list[dict], path: Path) -> str:
    lines = [f"tokenize: {c['samples']} samples ({c['tokens']} tokens, {c['supervised_tokens']} supervised) "
             f"-> {path}",
             f"  from {c['input_records']} answers: mismatched {c['mismatched']} (returned ids vs "
             f"re-wrapped text: {summary_by_kind(c.get('mismatch_kinds', {}))}), truncated {c['truncated']}, "
             f"kept cut-by-length {c['kept_length']}; "
             f"dropped: length {c['dropped_length']}, no supervised tokens "
             f"{c['dropped_no_supervised_tokens']}, empty answer {c['dropped_empty_answer']}, "
             f"duplicate id {c['dropped_duplicate_id']}"]
    if c.get("malformed"):
        reasons = ", ".join(f"{n} {why}" for why, n in sorted(c["malformed_reasons"].items(), key=lambda kv: -kv[1]))
        lines.append(f"  answer quality: {c['malformed']} of {c['input_records']} answers malformed ({reasons}); "
                     "kept with the ids the model returned")
    if c.get("text_derived"):
        lines.append(f"warning: {c['text_derived']} samples are text-derived (ids re-wrapped from "
                     "reasoning/content, not returned by the server)")
    return "\n".join(lines + report_lines(c.get("mismatch_kinds", {}), mismatches))
