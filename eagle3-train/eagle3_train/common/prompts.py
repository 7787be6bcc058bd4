"""Prompts for 01b: conversations from a local JSONL/JSON file or a Hugging Face dataset.

Accepted row shapes (detected per row):
  {"messages": [{"role": "user", "content": "..."}, ...]}            OpenAI / UltraChat
  {"conversations": [{"from": "human", "value": "..."}, ...]}        ShareGPT / open-perfectblend
  {"prompt": "..."}  or  {"question": "..."}                          a single user turn
The id is the row's own (`id`, `prompt_id`, `conversation_id`, `uuid`, `idx`), else a hash of the
conversation sent. A final assistant turn is dropped (01b regenerates it); earlier turns are kept
as given. Bad rows fail with one line naming the file and line (`skip_invalid` counts them instead).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from eagle3_train.common.errors import PipelineError
from eagle3_train.common.manifest import describe_file
from eagle3_train.common.store import json_sha256, jsonl_lines

ID_KEYS = ("id", "prompt_id", "conversation_id", "uuid", "idx")
ROLE_ALIASES = {
    "user": "user", "human": "user", "prompter": "user",
    "assistant": "assistant", "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant",
    "bing": "assistant", "model": "assistant",
    "system": "system",
}


@dataclass
class Prompt:
    id: str
    messages: list[dict]


@dataclass
class PromptSet:
    prompts: list[Prompt]
    source: dict                      # what was read (path + sha256, or dataset name + fingerprint)
    counts: dict = field(default_factory=dict)

    @property
    def ids(self) -> list[str]:
        return [p.id for p in self.prompts]

    def describe(self) -> dict:
        return {**self.source, "counts": self.counts, "ids_sha256": json_sha256(self.ids)}


class BadRow(ValueError):
    pass


# ----------------------------------------------------------------------------- one row

def _text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: only text is supported here
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise BadRow(f"{where}: content part of type {kind!r} is not supported (text only)")
        return "".join(parts)
    if content is None:
        raise BadRow(f"{where}: missing content")
    raise BadRow(f"{where}: content must be a string, got {type(content).__name__}")


def _turns(row: dict) -> list[dict]:
    if "messages" in row:
        raw, role_key, text_key = row["messages"], "role", "content"
    elif "conversations" in row:
        raw, role_key, text_key = row["conversations"], "from", "value"
        if isinstance(raw, list) and raw and isinstance(raw[0], dict) and "role" in raw[0]:
            role_key, text_key = "role", "content"  # some ShareGPT copies use OpenAI keys
    elif isinstance(row.get("prompt"), str) or isinstance(row.get("question"), str):
        return [{"role": "user", "content": row.get("prompt") if isinstance(row.get("prompt"), str)
                 else row["question"]}]
    else:
        raise BadRow(f"no 'messages', 'conversations', 'prompt' or 'question' field (keys: {sorted(row)[:8]})")
    if not isinstance(raw, list) or not raw:
        raise BadRow("the conversation is empty or not a list")
    turns = []
    for k, m in enumerate(raw):
        if not isinstance(m, dict):
            raise BadRow(f"turn {k} is not an object")
        role = ROLE_ALIASES.get(str(m.get(role_key, "")).lower())
        if role is None:
            raise BadRow(f"turn {k}: unknown or missing {role_key!r} ({m.get(role_key)!r})")
        turn = {"role": role, "content": _text(m.get(text_key), f"turn {k}")}
        for extra in ("reasoning_content", "reasoning"):  # earlier assistant turns may carry it
            if role == "assistant" and isinstance(m.get(extra), str):
                turn[extra] = m[extra]
        turns.append(turn)
    return turns


def conversation_to_send(turns: list[dict]) -> list[dict]:
    """Drop the final assistant turn (it is regenerated); the rest must end with a user turn."""
    if turns and turns[-1]["role"] == "assistant":
        turns = turns[:-1]
    if not turns or turns[-1]["role"] != "user":
        raise BadRow("the conversation does not end with a user turn (after dropping the final answer)")
    if not turns[-1]["content"].strip():
        raise BadRow("empty prompt (the last user turn has no text)")
    return turns


def content_id(messages: list[dict]) -> str:
    h = hashlib.sha256(json.dumps(messages, sort_keys=True, ensure_ascii=False).encode()).hexdigest()
    return "h" + h[:20]


def row_to_prompt(row, id_key: str | None = None) -> Prompt:
    if not isinstance(row, dict):
        raise BadRow(f"expected a JSON object, got {type(row).__name__}")
    messages = conversation_to_send(_turns(row))
    keys = (id_key,) if id_key else ID_KEYS
    rid = next((row[k] for k in keys if row.get(k) not in (None, "")), None)
    if id_key and rid is None:
        raise BadRow(f"no {id_key!r} field")
    return Prompt(str(rid) if rid is not None else content_id(messages), messages)


# ----------------------------------------------------------------------------- sources

def _jsonl_rows(path: Path) -> Iterator[tuple[str, object]]:
    for line in jsonl_lines(path, tolerate_torn_tail=False, objects=False):  # a bad row may be skipped later
        yield f"{path}:{line.lineno}", line.record


def _json_rows(path: Path) -> Iterator[tuple[str, object]]:
    try:
        data = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PipelineError(f"{path}: not valid JSON ({getattr(e, 'msg', e)})") from None
    if isinstance(data, dict):  # {"data": [...]} or {"train": [...]}: the one list inside
        lists = [v for v in data.values() if isinstance(v, list)]
        if len(lists) != 1:
            raise PipelineError(f"{path}: expected a JSON list of conversations (or an object holding one)")
        data = lists[0]
    if not isinstance(data, list):
        raise PipelineError(f"{path}: expected a JSON list of conversations")
    for n, row in enumerate(data):
        yield f"{path}[{n}]", row


def _hf_rows(name: str, split: str, config: str | None, revision: str | None):
    try:
        import datasets
    except ImportError:  # pragma: no cover - a declared dependency
        raise PipelineError("reading a hub dataset needs the `datasets` package") from None
    try:
        if Path(name).is_dir() and (Path(name) / "dataset_info.json").exists():
            ds = datasets.load_from_disk(name)
            if isinstance(ds, datasets.DatasetDict):
                ds = ds[split]
        else:
            ds = datasets.load_dataset(name, config, split=split, revision=revision)
    except PipelineError:
        raise
    except Exception as e:  # network, missing split, unknown dataset: say which in one line
        raise PipelineError(f"cannot load dataset {name!r} (split {split!r}): {type(e).__name__}: "
                            f"{str(e).splitlines()[0] if str(e) else ''}") from None
    desc = {"kind": "dataset", "name": name, "split": split, "config": config, "revision": revision,
            "fingerprint": getattr(ds, "_fingerprint", None), "num_rows": len(ds)}
    return desc, ((f"{name}[{split}][{i}]", row) for i, row in enumerate(ds))


def in_shard(pid: str, shard: tuple[int, int] | None) -> bool:
    """Shard by a hash of the id: stable under reordering, --limit and dataset growth."""
    if shard is None:
        return True
    i, n = shard
    return int(hashlib.sha256(pid.encode()).hexdigest()[:12], 16) % n == i


def parse_shard(text: str | None) -> tuple[int, int] | None:
    if not text:
        return None
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise PipelineError(f"--shard must look like I/N (e.g. 0/4), not {text!r}") from None
    if not (n >= 1 and 0 <= i < n):
        raise PipelineError(f"--shard {text}: need 0 <= I < N")
    return i, n


def repeated_id(seen: dict[str, tuple[str, str]], p: Prompt, where: str, *, what: str,
                identical_ok: bool = True) -> bool:
    """One id, one conversation (01a and 01b). Records where `p`'s id was first seen in `seen`;
    returns True when the id was seen before with the same conversation and `identical_ok` (a
    repeat the caller skips). Any other second row with that id is one error line naming the id
    and both rows: which of the two is meant cannot be guessed."""
    digest = content_id(p.messages)
    first = seen.get(p.id)
    if first is None:
        seen[p.id] = (where, digest)
        return False
    first_where, first_digest = first
    if identical_ok and first_digest == digest:
        return True
    differing = " with different conversations" if first_digest != digest else ""
    raise PipelineError(f"{where}: id {p.id!r} appears twice{differing} (first at {first_where}); one {what} "
                        "per id: give each row its own id (or drop one)")


def select(rows: Iterable[tuple[str, object]], *, limit: int | None = None,
           shard: tuple[int, int] | None = None, id_key: str | None = None,
           skip_invalid: bool = False) -> tuple[list[Prompt], dict]:
    """Rows -> prompts: validated, deduplicated by id (a row repeating an earlier one is skipped;
    one with the same id but another conversation is refused, or counted and skipped with
    skip_invalid), sharded, limited."""
    out, seen = [], {}
    counts = {"rows_read": 0, "invalid": 0, "duplicates": 0, "duplicates_differing": 0,
              "other_shards": 0}
    for where, row in rows:
        if limit is not None and len(out) >= limit:
            break
        counts["rows_read"] += 1
        try:
            p = row_to_prompt(row, id_key)
        except BadRow as e:
            if skip_invalid:
                counts["invalid"] += 1
                continue
            raise PipelineError(f"{where}: {e}") from None
        try:
            if repeated_id(seen, p, where, what="prompt"):
                counts["duplicates"] += 1  # the same conversation again: asked once
                continue
        except PipelineError:
            if not skip_invalid:
                raise
            counts["duplicates"] += 1  # --skip-invalid: the first row of the id wins, counted
            counts["duplicates_differing"] += 1
            continue
        if not in_shard(p.id, shard):
            counts["other_shards"] += 1
            continue
        out.append(p)
    counts["selected"] = len(out)
    return out, counts


def load_prompts(source: str, *, split: str = "train", config: str | None = None,
                 revision: str | None = None, limit: int | None = None, shard: tuple[int, int] | None = None,
                 id_key: str | None = None, skip_invalid: bool = False, flag: str = "--input") -> PromptSet:
    """A local .jsonl/.json file, a saved dataset directory, or a hub dataset name (only then is
    the hub touched). `flag` is the option that named `source`, for the error lines (01b's
    --input, 05's --prompts)."""
    if limit is not None and limit < 1:
        raise PipelineError(f"--limit must be >= 1, not {limit}")
    path = Path(source)
    if path.is_file():
        if path.suffix == ".json":
            rows = _json_rows(path)
        elif path.suffix in (".jsonl", ".ndjson"):
            rows = _jsonl_rows(path)
        else:
            raise PipelineError(f"{path}: unsupported file type {path.suffix!r} (use .jsonl or .json, "
                                "or a dataset directory / hub name)")
        desc = {"kind": "file", **describe_file(path)}
    elif path.is_dir() or (source.count("/") == 1 and not source.startswith((".", "/"))
                           and path.suffix not in (".json", ".jsonl", ".ndjson")):
        desc, rows = _hf_rows(source, split, config, revision)
    else:
        raise PipelineError(f"{flag} {source!r}: no such file, and not a dataset name (owner/name)")
    prompts, counts = select(rows, limit=limit, shard=shard, id_key=id_key, skip_invalid=skip_invalid)
    if not prompts:
        raise PipelineError(f"{flag} {source}: no prompts selected ({counts})")
    return PromptSet(prompts, desc, counts)


def sample_seed(seed: int | None, pid: str) -> int | None:
    """Per-sample seed from the run seed and the id: reproducible, yet not one stream for all (one
    seed for every request would give them all the same draws: at temperature > 0 their answers
    would stop, branch and be accepted together)."""
    if seed is None:
        return None
    return (seed * 1_000_003 + int(hashlib.sha256(pid.encode()).hexdigest()[:8], 16)) % (2 ** 31)
