#!/usr/bin/env python3
"""Look inside 01b / tokenize outputs over SSH.

    python scripts/inspect_samples.py runs/gen                    # summary of every file there
    python scripts/inspect_samples.py runs/gen --id q00042        # one sample, tokens and loss mask
    python scripts/inspect_samples.py runs/gen/tokenized/data.jsonl --id q00042 --table

Summary: counts, length percentiles, finish reasons, error types, attempts, latency. One sample:
the prompt, the reasoning, the content, then the training sequence as tokens separated by `|`,
in blocks by loss mask (`loss 0` = context, `loss 1` = supervised), special tokens marked, and any
mismatch between the returned ids and the re-wrapped text (`--table`: one token per line).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

RAW, ERRORS, DATA = "raw_responses.jsonl", "errors.jsonl", "data.jsonl"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", help="an 01b output dir, a tokenized dir, or one of their .jsonl files")
    p.add_argument("--id", default=None, help="show this sample (default: summary of the files)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer for the token view (default: the one in the manifests, else --model's)")
    p.add_argument("--table", action="store_true", help="one token per line: position, id, mask, text")
    p.add_argument("--color", choices=("auto", "always", "never"), default="auto",
                   help="ANSI colours (default: auto, when stdout is a terminal)")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- files

def find_files(path: Path) -> dict[str, Path]:
    if path.is_file():
        kind = {RAW: "raw", ERRORS: "errors", DATA: "data"}.get(path.name)
        if kind is None:  # guess from the first record
            first = next(iter_jsonl(path), {})
            kind = "data" if "input_ids" in first else "errors" if "error_type" in first else "raw"
        return {kind: path}
    out = {}
    for kind, rel in (("raw", RAW), ("errors", ERRORS), ("data", DATA), ("data", f"tokenized/{DATA}")):
        if (path / rel).exists() and kind not in out:
            out[kind] = path / rel
    if not out:
        sys.exit(f"error: no {RAW}, {ERRORS} or {DATA} in {path}")
    return out


def iter_jsonl(path: Path):
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                print(f"warning: {path}:{n} is not valid JSON (a torn last line?)", file=sys.stderr)


def manifest_of(path: Path) -> dict:
    m = path.parent / "manifest.json"
    try:
        return json.loads(m.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


# ----------------------------------------------------------------------------- summary

def pct(values: list[float]) -> str:
    if not values:
        return "-"
    v = sorted(values)

    def q(p):
        return v[min(len(v) - 1, int(p * (len(v) - 1) + 0.5))]
    fmt = (lambda x: f"{x:.2f}") if isinstance(v[0], float) else str
    return f"min {fmt(v[0])}  p50 {fmt(q(.5))}  p90 {fmt(q(.9))}  p99 {fmt(q(.99))}  max {fmt(v[-1])}  (n={len(v)})"


def summarize_raw(path: Path) -> list[str]:
    recs = list(iter_jsonl(path))
    ids = Counter(r.get("id") for r in recs)
    out = [f"{path}: {len(recs)} answers, {len(ids)} ids" + (f", {sum(c - 1 for c in ids.values())} DUPLICATES"
                                                              if len(ids) != len(recs) else "")]
    out.append(f"  finish reasons   {dict(Counter(r.get('finish_reason') for r in recs))}")
    out.append(f"  prompt tokens    {pct([len(r.get('prompt_token_ids') or ()) for r in recs])}")
    out.append(f"  answer tokens    {pct([len(r.get('token_ids') or ()) for r in recs])}")
    out.append(f"  reasoning chars  {pct([len(r.get('reasoning') or '') for r in recs])}")
    out.append(f"  content chars    {pct([len(r.get('content') or '') for r in recs])}")
    out.append(f"  no reasoning {sum(not r.get('reasoning') for r in recs)}, "
               f"no content {sum(not r.get('content') for r in recs)}")
    out.append(f"  attempts         {dict(sorted(Counter(r.get('attempts') for r in recs).items()))}")
    out.append(f"  latency s        {pct([float(r.get('latency_s') or 0) for r in recs])}")
    out.append(f"  endpoints        {dict(Counter(r.get('endpoint') for r in recs))}")
    return out


def summarize_errors(path: Path) -> list[str]:
    recs = list(iter_jsonl(path))
    out = [f"{path}: {len(recs)} ids without an answer"]
    if recs:
        out.append(f"  error types      {dict(Counter(r.get('error_type') for r in recs).most_common())}")
        out.append(f"  statuses         {dict(Counter(r.get('status') for r in recs))}")
        out.append(f"  attempts         {dict(sorted(Counter(r.get('attempts') for r in recs).items()))}")
        last = recs[-1]
        out.append(f"  last: {last.get('id')}: {last.get('error_type')}: {last.get('message')}")
    return out


def summarize_data(path: Path) -> list[str]:
    recs = list(iter_jsonl(path))
    st = [r.get("stats", {}) for r in recs]
    out = [f"{path}: {len(recs)} training samples"]
    out.append(f"  sequence tokens  {pct([len(r['input_ids']) for r in recs])}")
    out.append(f"  supervised       {pct([sum(r['loss_mask']) for r in recs])}")
    out.append(f"  truncated {sum(bool(s.get('num_truncated')) for s in st)}, "
               f"mismatched {sum(bool(s.get('mismatch')) for s in st)}, "
               f"sources {dict(Counter(s.get('source') for s in st))}, "
               f"finish {dict(Counter(s.get('finish_reason') for s in st))}")
    return out


def summary(files: dict[str, Path]) -> None:
    for kind, path in files.items():
        lines = {"raw": summarize_raw, "errors": summarize_errors, "data": summarize_data}[kind](path)
        m = manifest_of(path)
        flat = {k: v for k, v in m.get("counts", {}).items() if not isinstance(v, dict)}
        state = "complete" if m.get("complete") else "MISSING (run not finished)"
        lines.insert(1, f"  manifest         {state}" + (f", counts {json.dumps(flat)}" if m else ""))
        print("\n".join(lines) + "\n")


# ----------------------------------------------------------------------------- one sample

class Paint:
    def __init__(self, on: bool):
        self.on = on

    def __call__(self, text: str, code: str) -> str:
        return f"\033[{code}m{text}\033[0m" if self.on else text


def token_view(ids: list[int], mask: list[int], tok, paint: Paint, table: bool) -> str:
    special = set(getattr(tok, "all_special_ids", []) or [])
    pieces = [tok.decode([t], skip_special_tokens=False) for t in ids]
    if table:
        rows = [f"{'pos':>6} {'id':>8} mask  token"]
        rows += [f"{i:>6} {t:>8} {m:>4}  {p!r}" for i, (t, m, p) in enumerate(zip(ids, mask, pieces))]
        return "\n".join(rows)
    out, i = [], 0
    while i < len(ids):
        j = i
        while j < len(ids) and mask[j] == mask[i]:
            j += 1
        head = f"── loss {mask[i]}: positions {i}..{j - 1} ({j - i} tokens) ──"
        body = "|".join(paint(p.replace("\n", "\\n"), "1;35") if t in special else
                        paint(p.replace("\n", "\\n"), "32" if mask[i] else "2")
                        for t, p in zip(ids[i:j], pieces[i:j]))
        out += [paint(head, "1"), body]
        i = j
    return "\n".join(out)


def load_tokenizer(args, files: dict[str, Path]):
    names = [args.tokenizer]
    for p in files.values():
        m = manifest_of(p)
        names += [m.get("tokenizer", {}).get("name_or_path"), m.get("config", {}).get("tokenizer"),
                  m.get("config", {}).get("model")]
    for name in filter(None, names):
        try:
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(name, trust_remote_code=True)
        except (OSError, ValueError):
            continue
    return None


def show(args, files: dict[str, Path]) -> int:
    paint = Paint(args.color == "always" or (args.color == "auto" and sys.stdout.isatty()))
    found = {k: next((r for r in iter_jsonl(p) if str(r.get("id")) == args.id), None) for k, p in files.items()}
    if not any(found.values()):
        print(f"error: id {args.id!r} is in none of {', '.join(map(str, files.values()))}", file=sys.stderr)
        return 2
    tok = load_tokenizer(args, files)
    raw, data = found.get("raw"), found.get("data")
    if raw:
        print(paint(f"== {raw['id']}  finish={raw.get('finish_reason')}  attempts={raw.get('attempts')}  "
                    f"latency={raw.get('latency_s')}s  endpoint={raw.get('endpoint')}", "1"))
        for m in raw.get("messages", []):
            print(paint(f"[{m.get('role')}]", "1;34"), m.get("content"))
        print(paint("[reasoning]", "1;33"), raw.get("reasoning"))
        print(paint("[content]", "1;33"), raw.get("content"))
        print(f"prompt tokens {len(raw.get('prompt_token_ids') or ())}, "
              f"answer tokens {len(raw.get('token_ids') or ())}")
    if found.get("errors"):
        e = found["errors"]
        print(paint(f"[error] {e.get('error_type')} (status {e.get('status')}, {e.get('attempts')} attempts, "
                    f"retryable {e.get('retryable')}): {e.get('message')}", "1;31"))
    if data is None and raw and tok is not None:
        from eagle3_train.common.tokenization import ChatFormat, tokenize_sample

        fmt = ChatFormat.from_tokenizer(tok)
        t = tokenize_sample(raw, fmt)
        data = {"input_ids": t.input_ids, "loss_mask": t.loss_mask,
                "stats": {"mismatch": t.mismatch, "source": t.source}}
    if data is not None:
        if tok is None:
            print("(no tokenizer found: pass --tokenizer to see the tokens)")
        else:
            print(paint("[training sequence]", "1;36"), f"{len(data['input_ids'])} tokens, "
                  f"{sum(data['loss_mask'])} supervised, source {data.get('stats', {}).get('source')}")
            print(token_view(data["input_ids"], data["loss_mask"], tok, paint, args.table))
        mm = data.get("stats", {}).get("mismatch")
        print(paint(f"MISMATCH returned ids vs re-wrapped text: {mm}", "1;31") if mm else
              "returned ids == re-wrapped text" if data.get("stats", {}).get("source") == "token_ids" else "")
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    files = find_files(Path(args.path))
    if args.id is None:
        summary(files)
        return 0
    return show(args, files)


if __name__ == "__main__":
    sys.exit(main())
