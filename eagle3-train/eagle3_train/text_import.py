"""Answers without token ids -> 01b-format records whose ids are re-wrapped from the text.

For servers that return no ids (SGLang, a hosted API; 01b `--allow-text-fallback`) and for data
sets of earlier answers with only `reasoning` / `content` (01a_import_text.py). The ids come from
the one tokenization module's re-wrap (`ChatFormat.rewrap`); every such record says
`source: "text"`, and so do the manifests after it, so a text-derived set never passes for one the
server tokenized.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

from .errors import PipelineError

TEXT_WARNING = ("text cannot restore the exact tokenization the target chose, whitespace its reasoning "
                "parser stripped (e.g. a newline before </think>), or special tokens written inside "
                "the text; a server that returns token ids gives exact data")
FINISH_REASONS = ("stop", "length")


def text_answer(fmt, messages: list[dict], answer: dict) -> dict:
    """`answer` (reasoning, content, finish_reason, ...) with ids re-wrapped from its texts."""
    prompt, gen = fmt.rewrap(messages, answer.get("reasoning"), answer.get("content"),
                             answer.get("finish_reason") or "stop")
    return {**answer, "prompt_token_ids": prompt, "token_ids": gen, "source": "text"}


def has_special_text(fmt, *texts: str | None) -> bool:
    """A special token's string inside the text: it encodes as that token, whatever the target wrote."""
    specials = [t for t in getattr(fmt.tokenizer, "all_special_tokens", []) if t]
    return any(s in t for t in texts if t for s in specials)


def text_warning(n: int, total: int, with_specials: int | None = None) -> str:
    specials = "" if with_specials is None else f" ({with_specials} with special-token strings in their text)"
    return f"warning: {n} of {total} answers have text-derived ids{specials}: {TEXT_WARNING}"


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


def import_text_answers(input_path: Path, out_dir: Path, fmt, *, tokenizer_name: str, model: str | None = None,
                        id_key: str | None = None, overwrite: bool = False, log=print) -> dict:
    """JSONL of {id?, messages|conversations|prompt, reasoning, content, finish_reason?} ->
    `out_dir/raw_responses.jsonl` + run_config.json + manifest (stage 01b, `source: "text"`).

    Rebuilt whole each time (temp file + rename, manifest last); the previous output stays
    complete until the new one has been read without error. Refuses a directory that holds a
    01b run unless `overwrite` (which moves it aside)."""
    from .generate import RAW, RUN_CONFIG, STAGE, identity_of, move_aside
    from .manifest import MANIFEST, describe_file, describe_tokenizer, read_manifest, write_manifest
    from .prompts import BadRow, jsonl_rows, row_to_prompt
    from .store import DirLock, JsonlWriter, TMP_PREFIX, atomic_write_json, clean_temp_files

    input_path, out_dir = Path(input_path), Path(out_dir)
    if not input_path.is_file():
        raise PipelineError(f"--input {input_path}: no such file")
    with DirLock(out_dir, STAGE):
        clean_temp_files(out_dir)
        if overwrite:
            moved = move_aside(out_dir)
            if moved:
                log(f"--overwrite: moved the previous output to {moved}")
        elif (out_dir / RAW).exists():
            try:
                old = read_manifest(out_dir, STAGE)
            except PipelineError:
                old = None
            if not (old and old.get("source") == "text"):
                raise PipelineError(f"{out_dir} already holds {RAW} that was not imported from text (a 01b "
                                    "run?): use another --output-dir, or --overwrite to move it aside")
        tmp = out_dir / f"{TMP_PREFIX}{RAW}"
        seen: set[str] = set()
        counts, finish = Counter(), Counter()
        try:
            with JsonlWriter(tmp, fsync=False) as w:
                for where, row in jsonl_rows(input_path):
                    if not isinstance(row, dict):
                        raise PipelineError(f"{where}: expected a JSON object, got {type(row).__name__}")
                    try:
                        p = row_to_prompt(row, id_key)
                    except BadRow as e:
                        raise PipelineError(f"{where}: {e}") from None
                    if p.id in seen:
                        raise PipelineError(f"{where}: id {p.id!r} appears twice; one answer per id")
                    seen.add(p.id)
                    rec = {"id": p.id, "messages": p.messages,
                           **text_answer(fmt, p.messages, _answer_of(row, where))}
                    counts["prompt_tokens"] += len(rec["prompt_token_ids"])
                    counts["generated_tokens"] += len(rec["token_ids"])
                    counts["with_special_token_text"] += has_special_text(fmt, rec["reasoning"], rec["content"])
                    finish[rec["finish_reason"]] += 1
                    w.write(rec)
            if not seen:
                raise PipelineError(f"{input_path}: no answers in the file")
            (out_dir / MANIFEST).unlink(missing_ok=True)  # from here the directory is incomplete
            os.replace(tmp, out_dir / RAW)
        finally:
            if tmp.exists():
                tmp.unlink()
        ident = identity_of(input=str(input_path.resolve()), model=model,
                            chat_template_kwargs=fmt.chat_template_kwargs)
        atomic_write_json(out_dir / RUN_CONFIG, ident)
        n = len(seen)
        config = {"input": str(input_path), "model": model, "tokenizer": tokenizer_name, "id_field": id_key,
                  "chat_template_kwargs": fmt.chat_template_kwargs}
        manifest = write_manifest(
            out_dir, STAGE, config=config, inputs={"answers": describe_file(input_path)},
            outputs={"raw_responses": describe_file(out_dir / RAW)},
            counts={"requested": n, "answered": n, "failed": 0, "finish_reasons": dict(finish),
                    "error_types": {}, "prompt_tokens": counts["prompt_tokens"],
                    "generated_tokens": counts["generated_tokens"], "records_in_file": n, "text_derived": n,
                    "with_special_token_text": counts["with_special_token_text"],
                    "this_run": {"answered": n, "failed": 0, "retries": 0}},
            target={"model": model, "base_urls": []}, identity=ident, source="text", text_derived=True,
            text_warning=TEXT_WARNING, tokenizer=describe_tokenizer(fmt.tokenizer, tokenizer_name),
            chat_format=fmt.describe())
    log(f"01a: {n} answers imported from {input_path} ({counts['prompt_tokens']} prompt + "
        f"{counts['generated_tokens']} generated tokens, re-wrapped from text) -> {out_dir / RAW}")
    log(text_warning(n, n, counts["with_special_token_text"]))
    return manifest
