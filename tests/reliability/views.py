"""Views: an output directory reduced to what must be equal between two runs of the same command.
JSONL as a multiset of records (each line parsed strictly: a torn or malformed line, or a duplicate
id, fails), safetensors and torch files as tensors (bitwise), JSON without the fields that name a
time, a pid or the run's own directory; and each stage's own view (VIEWS)."""
from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path

TMP_PREFIX = ".tmp-"

# Fields that legitimately differ between two runs of the same command.
VOLATILE = frozenset({"created", "time", "pid", "command", "git_sha", "latency_s", "tokens_per_s",
                      "elapsed_s", "wall_s", "duration_s", "started", "finished", "this_run", "t",
                      "timestamp", "host", "hostname", "cpu_s"})
# Files that are never output: the lock, the human progress log.
NOT_OUTPUT = frozenset({".lock", "progress.log"})


def walk_files(out: Path):
    if not out.exists():
        return
    for dirpath, dirnames, filenames in os.walk(out):
        dirnames.sort()
        for name in sorted(filenames):
            yield Path(dirpath) / name


def _norm(obj, drop: frozenset, subs: tuple[tuple[str, str], ...]):
    if isinstance(obj, dict):
        return {k: _norm(v, drop, subs) for k, v in obj.items() if k not in drop}
    if isinstance(obj, list):
        return [_norm(v, drop, subs) for v in obj]
    if isinstance(obj, str):
        for a, b in subs:
            obj = obj.replace(a, b)
        return obj
    return obj


def strict_jsonl(path: Path) -> list[dict]:
    """Every line must be a complete JSON object ending in a newline: a torn line fails here."""
    data = Path(path).read_bytes()
    if data and not data.endswith(b"\n"):
        raise AssertionError(f"{path}: torn last line {data[-80:]!r}")
    recs = []
    for i, line in enumerate(data.split(b"\n")[:-1] if data else [], 1):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            raise AssertionError(f"{path}:{i}: not a JSON line: {line[:120]!r}") from None
        assert isinstance(rec, dict), f"{path}:{i}: not an object"
        recs.append(rec)
    return recs


def jsonl_view(path: Path, *, key: str | None = "id", drop: Iterable[str] = (), subs=()) -> list[str]:
    """A JSONL file as a sorted multiset of normalised records; with `key`, each value once."""
    recs = strict_jsonl(path)
    if key is not None:
        ids = [r.get(key) for r in recs if key in r]
        dup = sorted({i for i in ids if ids.count(i) > 1})
        assert not dup, f"{path}: duplicate {key}s {dup[:10]}"
    d = VOLATILE | frozenset(drop)
    return sorted(json.dumps(_norm(r, d, tuple(subs)), sort_keys=True) for r in recs)


def json_view(path: Path, *, drop: Iterable[str] = (), subs=()):
    return _norm(json.loads(Path(path).read_text()), VOLATILE | frozenset(drop), tuple(subs))


def _digest(t) -> tuple:
    import torch

    shape = tuple(t.shape)
    t = t.detach().cpu().reshape(-1).contiguous()
    raw = t.view(torch.uint8) if t.dtype != torch.bool else t.to(torch.uint8)
    return (str(t.dtype), shape, hashlib.sha256(raw.numpy().tobytes()).hexdigest())


def safetensors_view(path: Path) -> dict:
    """Tensor name -> (dtype, shape, sha256 of the bytes): equal views = bitwise-equal tensors
    (NaN-safe). The file's metadata is part of the view."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        view = {k: _digest(f.get_tensor(k)) for k in f.keys()}
        view["__metadata__"] = f.metadata()
    return view


def torch_view(path: Path, *, drop: Iterable[str] = (), subs=()):
    """A torch.save'd object with every tensor replaced by its digest."""
    import numpy as np
    import torch

    def walk(o):
        if isinstance(o, torch.Tensor):
            return _digest(o)
        if isinstance(o, np.ndarray):
            return ("ndarray", str(o.dtype), o.shape, hashlib.sha256(np.ascontiguousarray(o).tobytes()).hexdigest())
        if isinstance(o, dict):
            return {str(k): walk(v) for k, v in o.items() if k not in d}
        if isinstance(o, list | tuple):
            return [walk(v) for v in o]
        if isinstance(o, str):
            for a, b in subs:
                o = o.replace(a, b)
        return o

    d = VOLATILE | frozenset(drop)
    return walk(torch.load(path, map_location="cpu", weights_only=False))


def file_view(path: Path, **kw):
    """By suffix: JSONL/JSON/safetensors/torch views, else the bytes' sha256."""
    p = Path(path)
    if p.suffix == ".jsonl":
        return jsonl_view(p, key=kw.get("key", "id"), drop=kw.get("drop", ()), subs=kw.get("subs", ()))
    if p.suffix == ".json":
        return json_view(p, drop=kw.get("drop", ()), subs=kw.get("subs", ()))
    if p.suffix == ".safetensors":
        return safetensors_view(p)
    if p.suffix in (".pt", ".pth", ".bin"):
        return torch_view(p, drop=kw.get("drop", ()), subs=kw.get("subs", ()))
    return hashlib.sha256(p.read_bytes()).hexdigest()


def temp_files(out: Path) -> list[str]:
    return [str(p.relative_to(out)) for p in Path(out).rglob("*") if any(
        part.startswith(TMP_PREFIX) for part in p.relative_to(out).parts)]


def tree_view(out: Path, *, ignore: Callable[[str], bool] = lambda rel: False, drop: Iterable[str] = (),
              drop_in: dict[str, Iterable[str]] | Callable[[str], Iterable[str]] | None = None,
              key_for: Callable[[str], str | None] = lambda rel: "id", extra_subs=()) -> dict:
    """Relative path -> file view for every output file under `out`. The run's own directory is
    replaced by <OUT> inside JSON, so two runs into different directories compare equal; `drop`
    removes more keys everywhere, `drop_in[rel]` in one file only. Temp files fail the view: a
    finished run must leave none."""
    out = Path(out)
    stale = temp_files(out)
    assert not stale, f"{out}: temp files left behind: {stale}"
    subs = ((str(out.resolve()), "<OUT>"), (str(out), "<OUT>"), *extra_subs)
    view = {}
    for p in walk_files(out):
        rel = str(p.relative_to(out))
        if p.name in NOT_OUTPUT or ignore(rel):
            continue
        more = drop_in(rel) if callable(drop_in) else (drop_in or {}).get(rel, ())
        view[rel] = file_view(p, key=key_for(rel), drop=(*drop, *more), subs=subs)
    return view


def diff_views(a: dict, b: dict, limit: int = 8) -> list[str]:
    """Readable differences between two views (for assertion messages)."""
    out = []
    for k in sorted(set(a) | set(b)):
        if k not in a:
            out.append(f"only in the second: {k}")
        elif k not in b:
            out.append(f"only in the first: {k}")
        elif a[k] != b[k]:
            va, vb = a[k], b[k]
            if isinstance(va, dict) and isinstance(vb, dict):
                sub = diff_views(va, vb, limit)
                out.append(f"{k}: " + "; ".join(sub)[:1500])
            elif isinstance(va, list) and isinstance(vb, list):
                only_a = [x for x in va if x not in vb][:2]
                only_b = [x for x in vb if x not in va][:2]
                out.append(f"{k}: {len(va)} vs {len(vb)} items; first-only {str(only_a)[:300]}; "
                           f"second-only {str(only_b)[:300]}")
            else:
                out.append(f"{k}: {str(va)[:200]} != {str(vb)[:200]}")
        if len(out) >= limit:
            break
    return out


# ----------------------------------------------------------------------------- each stage's view


def view01b(out: Path) -> dict:
    """Records arrive in completion order (concurrency): compared as a multiset by id. How an
    answer travelled (endpoint, attempts, the server's URL: 01b lets them change on a resume) and
    the manifest's file hashes (they follow the order) are not part of the data."""
    return tree_view(out, drop=("endpoint", "attempts", "base_url", "base_urls"),
                     drop_in={"manifest.json": ["outputs"]}, ignore=lambda rel: rel.startswith("replaced-"))


def view02(out: Path) -> dict:
    # `seq` orders index lines by time; --force only skips the disk estimate
    return tree_view(out, drop_in={"index.jsonl": ["seq"], "manifest.json": ["force"]},
                     key_for=lambda rel: "shard" if rel.startswith("index") else "id")


def view03(out: Path) -> dict:
    # whether the counts were reused from before a kill is provenance, not output
    return tree_view(out, drop_in={"manifest.json": ["token_freq"]})


def metrics_view(path: Path) -> list[str]:
    """04's metrics.jsonl: steps redone after a resume are logged again and the last record of a
    kind and step wins (its documented contract); `resume` records mark the restarts."""
    last = {}
    for rec in strict_jsonl(path):
        if rec.get("kind") == "resume":
            continue
        last[(rec.get("kind"), rec.get("step"))] = rec
    # what a step cost (time, throughput, CPU seconds) differs between runs; what it computed may not
    keep = lambda k: k not in ("time", "path") and not k.endswith("_s")  # noqa: E731
    return sorted(json.dumps({k: v for k, v in r.items() if keep(k)}, sort_keys=True) for r in last.values())


def _drop04(rel: str) -> list[str]:
    if rel == "manifest.json":
        return ["outputs"]
    if "/rng/" in rel:
        # 04 seeds torch only (its data order comes from random.Random(seed) objects), so the
        # process-global Python/NumPy generators it also saves hold whatever the process started
        # with: they differ between any two runs and nothing reads them.
        return ["python", "numpy"]
    return []


def view04(out: Path) -> dict:
    view = tree_view(out, ignore=lambda rel: rel in ("metrics.jsonl", "curves.png"), drop_in=_drop04)
    view["metrics.jsonl"] = metrics_view(out / "metrics.jsonl")
    view["curves.png exists"] = (out / "curves.png").exists()
    return view


VIEWS = {"01b": view01b, "01c": tree_view, "02": view02, "03": view03, "04": view04, "05": tree_view}
