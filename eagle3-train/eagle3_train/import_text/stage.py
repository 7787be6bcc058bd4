"""Answers without token ids -> 01b-format records whose ids are re-wrapped from the text.

For servers that return no ids (SGLang, a hosted API; 01b `--allow-text-fallback`) and for data
sets of earlier answers with only `reasoning` / `content` (01a_import_text.py: `run`). The
ids come from the one tokenization module's re-wrap (`ChatFormat.rewrap`); every such record says
`source: "text"`, and so do the manifests after it, so a text-derived set never passes for one the
server tokenized.
"""

from __future__ import annotations

import os
from collections import Counter

from eagle3_train.common import rerun
from eagle3_train.common.config import GENERATE, IMPORT_TEXT
from eagle3_train.common.errors import PipelineError
from eagle3_train.common.manifest import MANIFEST, describe_file, describe_tokenizer, write_manifest
from eagle3_train.common.progress import Progress
from eagle3_train.common.prompts import BadRow, repeated_id, row_to_prompt
from eagle3_train.common.layout import PROGRESS_LOG, RAW
from eagle3_train.common.store import TMP_PREFIX, DirLock, JsonlWriter, clean_temp_files, jsonl_lines
from eagle3_train.common.text_answers import TEXT_WARNING, has_special_text, text_answer, text_warning

FINISH_REASONS = ("stop", "length")


def _answer_of(row: dict, where: str) -> dict:
    if row.get("token_ids") is not None or row.get("prompt_token_ids") is not None:
        raise PipelineError(f"{where}: the record has token ids already; it is 01b output, so give its "
                            "directory to 01c instead of importing its text")
    reasoning = row.get("reasoning", row.get("reasoning_content"))
    content = row.get("content")
    if reasoning is None and content is None:
        raise PipelineError(f"{where}: no 'reasoning' and no 'content': nothing to import")
    for key, val in (("reasoning", reasoning), ("content", content)):
        if val is not None and not isinstance(val, str):
            raise PipelineError(f"{where}: '{key}' must be a string, got {type(val).__name__}")
    finish = row.get("finish_reason") or "stop"
    if finish not in FINISH_REASONS:
        raise PipelineError(f"{where}: finish_reason {finish!r} is not one of {', '.join(FINISH_REASONS)}")
    return {"reasoning": reasoning, "content": content, "finish_reason": finish}


def run(cfg) -> int:
    """01a for an ImportTextConfig: import, then (with --tokenize) tokenize as 01c does."""
    from eagle3_train.common.tokenization import chat_format_from_args

    fmt = chat_format_from_args(cfg)
    import_text_answers(cfg, fmt)
    if cfg.tokenize:
        from eagle3_train.tokenize.dataset import build_training_set

        build_training_set(cfg.output_dir, cfg.output_dir / "tokenized", fmt, tokenizer_name=cfg.tokenizer,
                           max_seq_len=cfg.max_seq_len, loss_on=cfg.loss_on, keep_length=cfg.keep_length,
                           progress_every=cfg.progress_every)
    return 0


def import_text_answers(cfg, fmt, log=print) -> dict:
    """`cfg.input`, JSONL of {id?, messages|conversations|prompt, reasoning, content,
    finish_reason?} -> `cfg.output_dir/raw_responses.jsonl` + manifest (stage 01b, `source: "text"`).

    Rebuilt whole each time (temp file + rename, manifest last); the previous output stays
    complete until the new one has been read without error. The rerun policy (rerun.py) refuses
    a 01b run's directory or an import of other settings unless --overwrite, which moves the old
    output aside only once the new input has been read without error."""
    out_dir = cfg.output_dir
    with DirLock(out_dir, IMPORT_TEXT):
        clean_temp_files(out_dir)
        if not cfg.overwrite:  # refuse before the work, not after
            rerun.prepare(cfg)
        tmp = out_dir / f"{TMP_PREFIX}{RAW}"
        seen: dict[str, tuple[str, str]] = {}  # id -> where first, its conversation's hash
        counts, finish = Counter(), Counter()
        try:
            # Closed before --overwrite moves the old output (progress.log among it) aside.
            with Progress("01a import", os.path.getsize(cfg.input), log_path=out_dir / PROGRESS_LOG,
                          every_s=cfg.progress_every, unit="B") as progress, JsonlWriter(tmp, fsync=False) as w:
                for line in jsonl_lines(cfg.input, tolerate_torn_tail=False):
                    progress.update(line.size)
                    where, row = f"{cfg.input}:{line.lineno}", line.record
                    try:
                        p = row_to_prompt(row, cfg.id_field)
                    except BadRow as e:
                        raise PipelineError(f"{where}: {e}") from None
                    repeated_id(seen, p, where, what="answer", identical_ok=False)
                    rec = {"id": p.id, "messages": p.messages,
                           **text_answer(fmt, p.messages, _answer_of(row, where))}
                    counts["prompt_tokens"] += len(rec["prompt_token_ids"])
                    counts["generated_tokens"] += len(rec["token_ids"])
                    counts["with_special_token_text"] += has_special_text(fmt, rec["reasoning"], rec["content"])
                    finish[rec["finish_reason"]] += 1
                    w.write(rec)
            if not seen:
                raise PipelineError(f"{cfg.input}: no answers in the file")
            if cfg.overwrite:
                rerun.prepare(cfg)
            (out_dir / MANIFEST).unlink(missing_ok=True)  # from here the directory is incomplete
            os.replace(tmp, out_dir / RAW)
        finally:
            if tmp.exists():
                tmp.unlink()
        n = len(seen)
        manifest = write_manifest(
            out_dir, GENERATE, config=cfg.to_dict(), inputs={"answers": describe_file(cfg.input)},
            outputs={"raw_responses": describe_file(out_dir / RAW)},
            counts={"requested": n, "answered": n, "failed": 0, "finish_reasons": dict(finish),
                    "error_types": {}, "prompt_tokens": counts["prompt_tokens"],
                    "generated_tokens": counts["generated_tokens"], "records_in_file": n, "text_derived": n,
                    "with_special_token_text": counts["with_special_token_text"],
                    "this_run": {"answered": n, "failed": 0, "retries": 0}},
            target={"model": cfg.model, "base_urls": []}, identity=cfg.identity(), written_by=IMPORT_TEXT,
            source="text", text_derived=True, text_warning=TEXT_WARNING,
            tokenizer=describe_tokenizer(fmt.tokenizer, cfg.tokenizer), chat_format=fmt.describe())
    log(f"01a: {n} answers imported from {cfg.input} ({counts['prompt_tokens']} prompt + "
        f"{counts['generated_tokens']} generated tokens, re-wrapped from text) -> {out_dir / RAW}")
    log(text_warning(n, n, counts["with_special_token_text"]))
    return manifest
