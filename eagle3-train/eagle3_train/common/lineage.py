"""Which sample ids a draft was trained on, read back through the manifests that made it, so 05
can refuse held-out prompts the draft has seen.

    the draft export -> its 04 run's manifest (beside the export: config.hidden_states, and the
    split: the ids it validated on) -> the hidden-state store (02's, or 01b's capture; its
    manifest must be the one 04 recorded) -> the store's sample ids (plan.json, else the file its
    manifest names as input: 01c's data.jsonl or 01b's raw_responses.jsonl)

The ids 04 validated on were not trained on. A link that cannot be read (a draft copied out of its
run, a store moved, remade or made elsewhere) raises Unreadable: 05 warns and goes on.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

from eagle3_train.common.config import EXTRACT, TRAIN
from eagle3_train.common.errors import PipelineError
from eagle3_train.common.manifest import MANIFEST, manifest_identity, read_manifest
from eagle3_train.common.split import is_heldout
from eagle3_train.common.store import jsonl_ids

PLAN = "plan.json"  # common/hidden_store.PLAN (that module needs torch; this one does not)


class Unreadable(Exception):
    """A link of the chain is missing or is not what the draft was trained on: says which."""


def trained_ids(train_manifest: dict, store_ids: Iterable[str], store_identity: str | None = None) -> set[str]:
    """The ids 04 trained on: the store's ids less those its manifest says it validated on (the
    explicit list; else the by-id rule with its fraction, when no cap moved held-out samples back
    into training). `store_identity` (manifest.manifest_identity of the store found) must be the
    one 04 recorded, when it recorded one: a store remade or grown since is not what it trained on."""
    recorded = ((train_manifest.get("inputs") or {}).get("hidden_states") or {}).get("manifest_identity")
    if recorded and store_identity and recorded != store_identity:
        raise Unreadable("the hidden-state store's manifest is not the one 04 trained on (remade or grown since)")
    split = train_manifest.get("split") or {}
    ids = set(store_ids)
    if "val_ids" in split:
        return ids - set(split["val_ids"] or ())
    fraction = split.get("val_fraction")
    capped = (train_manifest.get("config") or {}).get("val_max_samples") is not None
    if fraction and not capped:
        return {i for i in ids if not is_heldout(i, float(fraction))}
    return ids  # no split recorded (or one a cap made unknowable): count every stored sample


def store_ids(store: Path, manifest: dict) -> list[str]:
    """The sample ids of a hidden-state store: its plan.json (02's and the capture's), else the
    file its manifest names as its input."""
    plan = Path(store) / PLAN
    if plan.exists():
        try:
            return [i for shard in json.loads(plan.read_text())["shards"] for i in shard["ids"]]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise Unreadable(f"{plan} is not a readable store plan") from None
    inputs = manifest.get("inputs") or {}
    source = (inputs.get("training_set") or inputs.get("raw_responses") or {}).get("path")
    if not source or not Path(source).is_file():
        raise Unreadable(f"{store} has no {PLAN}, and the data it was made from ({source}) is not there")
    return jsonl_ids(Path(source))


def draft_trained_ids(draft: Path) -> set[str]:
    """The ids the draft at `draft` (04's RUN/export) was trained on, through the manifests."""
    draft = Path(draft)
    run = next((d for d in (draft, draft.parent) if (d / MANIFEST).exists()
                and _stage(d / MANIFEST) == TRAIN), None)
    if run is None:
        raise Unreadable(f"no 04 manifest beside {draft} (a draft copied out of its run)")
    man = _read(run, TRAIN)
    store = (man.get("config") or {}).get("hidden_states")
    if not store or not Path(store).is_dir():
        raise Unreadable(f"the hidden-state store 04 trained on ({store}) is not there (moved, or made elsewhere)")
    store_man = _read(Path(store), EXTRACT)
    return trained_ids(man, store_ids(Path(store), store_man), manifest_identity(Path(store)))


def check_heldout(draft: Path, prompt_ids: Sequence[str], *, flag: str = "--prompts") -> None:
    """Refuse, in one line, held-out prompts whose ids the draft trained on; where the chain
    cannot be read, one warning line, and go on."""
    try:
        trained = draft_trained_ids(draft)
    except Unreadable as e:
        print(f"warning: cannot check that {flag} were held out from the draft's training: {e}",
              file=sys.stderr, flush=True)
        return
    seen = [i for i in prompt_ids if i in trained]
    if seen:
        raise PipelineError(f"{len(seen)} of {len(prompt_ids)} {flag} ids were in the draft's training set (e.g. "
                            f"{', '.join(repr(i) for i in seen[:2])}): pass the split's heldout.jsonl "
                            "(01_split_prompts.py)")


def _stage(path: Path) -> str | None:
    try:
        return json.loads(Path(path).read_text()).get("stage")
    except (OSError, json.JSONDecodeError, AttributeError):
        return None


def _read(directory: Path, stage: str) -> dict:
    try:
        return read_manifest(directory, stage)
    except PipelineError as e:
        raise Unreadable(str(e)) from None
