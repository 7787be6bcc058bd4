"""Acceptance along the answer: drafts counted by where they stand in their sequence.

A draft is placed at the position (in prompt + answer, 0-based) of its first drafted token, and
counted in the bucket holding that position. The same counts come from three places and must mean
the same thing: 04's validation and 05's offline walk (the drafts of `acceptance.vllm_walk`) and
05 online (vLLM's per-request record, `--per-request-spec-decode-metrics detailed`: the ordered
accepted/drafted counts of every verify step). Online, the prefill makes the token at position P
(the prompt's length), the first draft proposes P + 1 onwards, and a step that accepts `a` tokens
moves the next draft a + 1 positions on (the bonus token), so a step's position is exact.

Counts are sums (they merge across batches, ranks and requests); rates come from `summarize`.
Where the counts were made one answer at a time (05 offline and online), they also say how many
answers drafted in each bucket: drafts of one answer rise and fall together (its topic, its graph,
its ending), so a bucket of a few long answers is noisy however many drafts it holds.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

# Bucket b holds positions EDGES[b] <= pos < EDGES[b + 1]; the last bucket is open.
EDGES = (0, 512, 2048, 8192, 16384)
# A bucket with fewer drafts, or drafts from fewer answers, than these is marked: its rates are too
# noisy to compare (one answer's AL in a bucket spreads ~0.26 around the mean at K = 7).
MIN_DRAFTS = 50
MIN_ANSWERS = 8
# `--position-buckets` (04 and 05): the boundaries after 0, as parse_edges reads them.
BUCKETS = "512,2k,8k,16k"
BUCKETS_HELP = ("acceptance by position: the draft's first token's position in prompt + answer, bucketed at "
                "these boundaries (tokens, ascending, k = 1024)")


def parse_edges(text: str) -> tuple[int, ...]:
    """'512,2k,8k,16k' -> (0, 512, 2048, 8192, 16384): the bucket boundaries after 0, ascending;
    'k' multiplies by 1024. ValueError with the reason otherwise."""
    out = [0]
    for part in (p.strip().lower() for p in str(text).split(",")):
        if not part:
            raise ValueError(f"empty boundary in {text!r}")
        mult = 1024 if part.endswith("k") else 1
        try:
            val = int(part[:-1] if mult > 1 else part) * mult
        except ValueError:
            raise ValueError(f"{part!r} is not a whole number of tokens (e.g. 512 or 2k)") from None
        if val <= out[-1]:
            raise ValueError(f"boundaries must be positive and ascending, not {text!r}")
        out.append(val)
    if len(out) < 2:
        raise ValueError(f"give at least one boundary, not {text!r}")
    return tuple(out)


def edges_of_flag(text: str, flag: str = "--position-buckets") -> tuple[int, ...]:
    """parse_edges for a stage's flag: a bad value is one PipelineError line naming the flag and the fix."""
    from eagle3_train.common.errors import PipelineError

    try:
        return parse_edges(text)
    except ValueError as e:
        raise PipelineError(f"{flag}: {e}; give ascending token counts after 0, e.g. {BUCKETS}") from None


def _short(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def labels(edges: Sequence[int] = EDGES) -> list[str]:
    """'0-512', '512-2k', ..., '16k+'."""
    edges = list(edges)
    return [f"{_short(a)}-{_short(b)}" for a, b in zip(edges, edges[1:])] + [f"{_short(edges[-1])}+"]


def bucket_of(pos: int, edges: Sequence[int] = EDGES) -> int:
    b = 0
    for i, e in enumerate(edges):
        if pos >= e:
            b = i
    return b


def empty(k: int, edges: Sequence[int] = EDGES) -> dict:
    n = len(edges)
    return {"edges": list(edges), "k": k, "drafts": [0] * n, "accepted": [0] * n,
            "hits": [[0] * k for _ in range(n)]}


def add(counts: dict, positions: Iterable[int], accepted: Iterable[int]) -> dict:
    """Add drafts (first drafted token's position, tokens accepted) to `counts` in place;
    `hits[b][j]`: drafts of bucket b with steps 0..j all accepted (vLLM's per-position count)."""
    k, edges = counts["k"], counts["edges"]
    for pos, acc in zip(positions, accepted):
        b = bucket_of(int(pos), edges)
        acc = min(int(acc), k)
        counts["drafts"][b] += 1
        counts["accepted"][b] += acc
        for j in range(acc):
            counts["hits"][b][j] += 1
    return counts


def count(positions: Iterable[int], accepted: Iterable[int], k: int, edges: Sequence[int] = EDGES) -> dict:
    return add(empty(k, edges), positions, accepted)


def step_positions(prompt_len: int, per_step_accepted: Sequence[int]) -> list[int]:
    """The first drafted position of each verify step of one vLLM request (see the module doc)."""
    out, pos = [], prompt_len + 1
    for a in per_step_accepted:
        out.append(pos)
        pos += int(a) + 1
    return out


def from_vllm_steps(prompt_len: int, per_step_accepted: Sequence[int], per_step_drafted: Sequence[int],
                    k: int, edges: Sequence[int] = EDGES) -> dict:
    """Counts of one request from vLLM's detailed per-request record. A step that drafted fewer
    than k tokens (the request's end near max_model_len) still counts as one draft."""
    if len(per_step_accepted) != len(per_step_drafted):
        raise ValueError(f"per_step_accepted ({len(per_step_accepted)}) and per_step_drafted "
                         f"({len(per_step_drafted)}) differ in length")
    return one_answer(count(step_positions(prompt_len, per_step_accepted), per_step_accepted, k, edges))


def one_answer(counts: dict) -> dict:
    """`counts` of one answer, marked so (in place): `answers[b]` = 1 where it drafted in bucket b."""
    counts["answers"] = [int(d > 0) for d in counts["drafts"]]
    return counts


def merge(parts: Sequence[dict]) -> dict:
    """Sums of counts made with the same edges (ValueError otherwise); k is the largest."""
    parts = [p for p in parts if p]
    if not parts:
        raise ValueError("nothing to merge")
    edges = parts[0]["edges"]
    if any(p["edges"] != edges for p in parts):
        raise ValueError("position counts made with different bucket edges")
    k = max(p["k"] for p in parts)
    out = empty(k, edges)
    for p in parts:
        for b in range(len(edges)):
            out["drafts"][b] += p["drafts"][b]
            out["accepted"][b] += p["accepted"][b]
            for j, h in enumerate(p["hits"][b]):
                out["hits"][b][j] += h
    if all("answers" in p for p in parts):  # a part counted otherwise (04's batches) leaves them unknown
        out["answers"] = [sum(p["answers"][b] for p in parts) for b in range(len(edges))]
    return out


def flatten(counts: dict) -> list[int]:
    """For an all-reduce; `unflatten` with the same k and edges inverts it."""
    return counts["drafts"] + counts["accepted"] + [h for row in counts["hits"] for h in row]


def unflatten(values: Sequence[float], k: int, edges: Sequence[int] = EDGES) -> dict:
    vals = [int(round(v)) for v in values]
    n = len(edges)
    out = empty(k, edges)
    out["drafts"], out["accepted"] = vals[:n], vals[n:2 * n]
    out["hits"] = [vals[2 * n + b * k: 2 * n + (b + 1) * k] for b in range(n)]
    return out


def summarize(counts: dict, min_drafts: int = MIN_DRAFTS, min_answers: int = MIN_ANSWERS) -> list[dict]:
    """One row a bucket: drafts, AL = 1 + accepted / drafts, per-position rates hits[j] / drafts
    (None where the bucket is empty), and `few` when it has under `min_drafts` drafts or, where the
    counts know their answers (`answers`, then in the row too), drafts from under `min_answers`."""
    rows = []
    answers = counts.get("answers")
    for b, label in enumerate(labels(counts["edges"])):
        n = counts["drafts"][b]
        row = {"bucket": label, "start": counts["edges"][b], "drafts": n,
               "acceptance_length": 1.0 + counts["accepted"][b] / n if n else None,
               "per_position_rate": [h / n for h in counts["hits"][b]] if n else None,
               "few": n < min_drafts}
        if answers is not None:
            row["answers"] = answers[b]
            row["few"] = row["few"] or answers[b] < min_answers
        rows.append(row)
    return rows


def block(counts: dict, min_drafts: int = MIN_DRAFTS, min_answers: int = MIN_ANSWERS) -> dict:
    """What 04's validation records and 05's offline result keep as `by_position`: the edges, the
    counts (sums, to merge later) and their `summarize` rows."""
    return {"edges": list(counts["edges"]), "counts": counts, "rows": summarize(counts, min_drafts, min_answers)}


def with_reach(block: dict, reach_counts: dict) -> dict:
    """`block` with an oracle draft's counts over the same buckets (`reach_counts`: the target's
    own greedy token at every depth, walked like the draft): each row gets `reach_al` (the oracle's
    AL) and `share_of_reach` (the draft's AL / it), None where either has no drafts."""
    if reach_counts["edges"] != block["edges"]:
        raise ValueError("reach counted with other bucket edges than the draft")
    rows = []
    for r, o in zip(block["rows"], summarize(reach_counts)):
        al, reach = r["acceptance_length"], o["acceptance_length"]
        rows.append({**r, "reach_al": reach, "share_of_reach": al / reach if al is not None and reach else None})
    return {**block, "rows": rows, "reach_counts": reach_counts}


def table(rows: Sequence[dict], k: int | None = None) -> str:
    """Markdown: bucket | drafts | AL | rate at each draft position (p1..pK) | note; with rows that
    count their answers, answers after drafts; with rows of `with_reach`, also reach (the oracle's
    AL) and share (AL / reach) after AL."""
    k = k if k is not None else max((len(r["per_position_rate"] or []) for r in rows), default=0)
    reach = any("reach_al" in r for r in rows)
    answers = all("answers" in r for r in rows) and bool(rows)
    head = ["position", "drafts"] + (["answers"] if answers else []) + ["AL"] + (["reach", "share"] if reach else []) \
        + [f"p{j + 1}" for j in range(k)] + ["note"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        extra = [f"{x:.3f}" if x is not None else "-" for x in (r.get("reach_al"), r.get("share_of_reach"))] \
            if reach else []
        n = [str(r["answers"])] if answers else []
        if not r["drafts"]:
            cells = [r["bucket"], "0", *n, "-"] + extra + ["-"] * k + ["no drafts"]
        else:
            rates = (r["per_position_rate"] + [None] * k)[:k]
            cells = [r["bucket"], str(r["drafts"]), *n, f"{r['acceptance_length']:.3f}"] + extra + \
                [f"{x:.3f}" if x is not None else "-" for x in rates] + [_few(r)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _few(row: dict) -> str:
    if not row["few"]:
        return ""
    return "few drafts" if row["drafts"] < MIN_DRAFTS else "few answers"
