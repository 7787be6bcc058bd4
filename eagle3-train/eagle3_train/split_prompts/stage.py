"""01_split_prompts' run: read the prompts, pick the held-out ids (common/split.py), write both
sets, the manifest last.

Output directory:
  run.json       the settings + the source's identity (rerun.py: a rerun must match)
  train.jsonl    {"id", "messages"} per line, the prompts not held out, in the source's order
  heldout.jsonl  the same for the held-out prompts
  manifest.json  written last: config, source, counts, seed, the held-out ids' hash
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from eagle3_train.common import rerun
from eagle3_train.common.manifest import MANIFEST, describe_file, is_complete, read_manifest, write_manifest
from eagle3_train.common.prompts import Prompt, load_prompts
from eagle3_train.common.split import PROMPT_SPLIT, heldout_count, pick_heldout
from eagle3_train.common.store import DirLock, atomic_write_text, clean_temp_files, file_sha256, json_sha256
from eagle3_train.split_prompts.config import HELDOUT_FILE, TRAIN_FILE, SplitConfig


def prompt_lines(prompts: Sequence[Prompt]) -> str:
    """JSONL that load_prompts reads back as the same ids and conversations."""
    return "".join(json.dumps({"id": p.id, "messages": p.messages}, ensure_ascii=False) + "\n" for p in prompts)


def split_texts(prompts: Sequence[Prompt], held: set[str]) -> dict[str, str]:
    """{train.jsonl: text, heldout.jsonl: text}: each side in the prompts' order."""
    return {TRAIN_FILE: prompt_lines([p for p in prompts if p.id not in held]),
            HELDOUT_FILE: prompt_lines([p for p in prompts if p.id in held])}


def write_texts(directory: Path, texts: dict[str, str]) -> dict[str, Path]:
    """Each file atomically; one that already holds the same text is left alone. {name: path}."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, text in texts.items():
        path = out[name] = directory / name
        if not path.exists() or path.read_text() != text:
            atomic_write_text(path, text)
    return out


def split_manifest(path: Path) -> dict | None:
    """The 01_split_prompts manifest when `path` is a split's train.jsonl (or heldout.jsonl), else None."""
    path = Path(path)
    if not path.is_file() or path.name not in (TRAIN_FILE, HELDOUT_FILE) or not (path.parent / MANIFEST).exists():
        return None
    try:
        return read_manifest(path.parent, SplitConfig.stage)
    except Exception:  # another stage's directory, or an unfinished split: not a split to use
        return None


def intact(out: Path) -> bool:
    """A finished split whose train.jsonl and heldout.jsonl are the files its manifest describes."""
    if not is_complete(out, SplitConfig.stage):
        return False
    made = read_manifest(out, SplitConfig.stage).get("outputs") or {}
    return all((out / name).is_file() and (made.get(name.removesuffix(".jsonl")) or {}).get("sha256")
               == file_sha256(out / name) for name in (TRAIN_FILE, HELDOUT_FILE))


def run(cfg: SplitConfig) -> int:
    out = cfg.output_dir
    # Bad input is refused before the output directory is even made.
    ps = load_prompts(cfg.input, split=cfg.split, config=cfg.dataset_config, limit=cfg.limit, id_key=cfg.id_field)
    count = heldout_count(cfg.heldout, len(ps.prompts))
    held = pick_heldout(ps.ids, count, cfg.seed)
    source = ps.describe()
    with DirLock(out, cfg.stage):
        clean_temp_files(out)
        rerun.prepare(cfg, inputs={"source": source})
        if intact(out):  # the same settings and source, its files as written: the split stands
            print(f"01: {out} already holds this split ({len(ps.prompts) - count} train + {count} held out); "
                  "nothing to do")
            return 0
        (out / MANIFEST).unlink(missing_ok=True)
        files = write_texts(out, split_texts(ps.prompts, held))
        counts = {"prompts": len(ps.prompts), "train": len(ps.prompts) - count, "heldout": count,
                  "source": ps.counts}
        write_manifest(out, cfg.stage, config=cfg.to_dict(), inputs={"source": source},
                       outputs={k.removesuffix(".jsonl"): describe_file(p) for k, p in files.items()},
                       counts=counts, seed=cfg.seed,
                       split={"rule": PROMPT_SPLIT, "heldout": cfg.heldout, "heldout_count": count,
                              "seed": cfg.seed, "heldout_ids_sha256": json_sha256(sorted(held))})
    print(f"01: {len(ps.prompts)} prompts of {cfg.input} -> {count} held out ({out / HELDOUT_FILE}), "
          f"{len(ps.prompts) - count} to train on ({out / TRAIN_FILE})")
    return 0
