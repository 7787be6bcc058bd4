"""Stage manifests: what a stage was run with and what it consumed, written last and atomically.

A stage's output directory counts as complete only once `manifest.json` is there with
`complete: true`. The next stage reads it and refuses inputs made with something else (another
tokenizer, another target, other layer ids), naming both values in one line.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

from eagle3_train.common.config import LEGACY_IDS
from eagle3_train.common.errors import PipelineError
from eagle3_train.common.store import TMP_PREFIX, atomic_write_json, file_sha256

MANIFEST = "manifest.json"


def describe_file(path: Path, *, hash_it: bool = True) -> dict:
    path = Path(path)
    st = path.stat()
    out = {"path": str(path.resolve()), "size": st.st_size}
    if hash_it:
        out["sha256"] = file_sha256(path)
    return out


def tokenizer_fingerprint(tokenizer) -> str:
    """Identity of a tokenizer as the pipeline sees it: vocabulary, special tokens, chat template."""
    h = hashlib.sha256()
    h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(json.dumps(sorted(getattr(tokenizer, "all_special_tokens", []))).encode())
    h.update((getattr(tokenizer, "chat_template", None) or "").encode()
             if isinstance(getattr(tokenizer, "chat_template", None), str | None) else
             json.dumps(tokenizer.chat_template, sort_keys=True).encode())
    return h.hexdigest()[:16]


def describe_tokenizer(tokenizer, name_or_path: str) -> dict:
    return {"name_or_path": str(name_or_path), "fingerprint": tokenizer_fingerprint(tokenizer),
            "vocab_size": len(tokenizer)}


def text_config(config):
    """The language model's config inside a multimodal wrapper (Kimi-K2.5), else the config."""
    return getattr(config, "text_config", None) or config


def describe_target(config, name_or_path: str) -> dict:
    cfg = text_config(config)
    return {"name_or_path": str(name_or_path), "model_type": cfg.model_type,
            "num_hidden_layers": cfg.num_hidden_layers, "hidden_size": cfg.hidden_size,
            "vocab_size": cfg.vocab_size}


def _git_sha() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def write_manifest(out_dir: Path, stage: str, *, config: dict, inputs: dict | None = None,
                   outputs: dict | None = None, counts: dict | None = None, **extra) -> dict:
    manifest = {
        "stage": stage,
        "complete": True,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "config": config,
        "inputs": inputs or {},
        "outputs": outputs or {},
        "counts": counts or {},
        "command": [sys.executable, *sys.argv],
        "git_sha": _git_sha(),
        "pid": os.getpid(),
        **extra,
    }
    # A kill during an earlier manifest write leaves its temp file; the writer of the manifest
    # owns the directory (its lock), so no one else can be mid-write on that name.
    for stale in Path(out_dir).glob(f"{TMP_PREFIX}{MANIFEST}.*"):
        stale.unlink(missing_ok=True)
    atomic_write_json(Path(out_dir) / MANIFEST, manifest)
    return manifest


def read_manifest(directory: Path, stage: str | None = None) -> dict:
    directory = Path(directory)
    path = directory / MANIFEST
    if not directory.exists():
        raise PipelineError(f"{directory} does not exist")
    if not path.exists():
        what = f"stage {stage}" if stage else "the stage that writes it"
        raise PipelineError(f"{directory} is incomplete (no {MANIFEST}): {what} did not finish; "
                            "rerun it to complete its output")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise PipelineError(f"{path} is not valid JSON ({e.msg} at line {e.lineno})") from None
    if stage is not None and LEGACY_IDS.get(manifest.get("stage"), manifest.get("stage")) != \
            LEGACY_IDS.get(stage, stage):
        raise PipelineError(f"{directory} holds the output of {manifest.get('stage')!r}, "
                            f"expected {stage!r}")
    if not manifest.get("complete"):
        raise PipelineError(f"{directory} is incomplete: its manifest is not marked complete")
    return manifest


VOLATILE_KEYS = ("created", "command", "git_sha", "pid")


def is_complete(directory: Path, stage: str) -> bool:
    """Whether `directory` holds a finished `stage` output (its manifest written and readable)."""
    try:
        read_manifest(directory, stage)
        return True
    except PipelineError:
        return False


def manifest_identity(directory: Path, stage: str | None = None) -> str:
    """What a stage's output *is*, for the stage that consumes it: its complete manifest without
    when/how it was written, so an identical rerun of a stage does not look like a new input."""
    manifest = read_manifest(directory, stage)
    return hashlib.sha256(json.dumps({k: v for k, v in manifest.items() if k not in VOLATILE_KEYS},
                                     sort_keys=True, default=str).encode()).hexdigest()


def manifest_of_file(path: Path, stage: str | None = None) -> dict:
    """The manifest of the directory a stage output file lives in."""
    return read_manifest(Path(path).parent, stage)


def require_match(what: str, expected, found, *, source: str) -> None:
    """One clear line naming both values when an input was made with something else."""
    if expected != found:
        raise PipelineError(f"{what} mismatch: {source} was made with {found!r}, "
                            f"but this run uses {expected!r}")
