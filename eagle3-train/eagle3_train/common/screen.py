"""01b's answers screened for garbled output before anything is trained on them.

A misconfigured target still answers every request (a chat template or reasoning parser that is
not the model's, a tokenizer other than the server's, sampling that loops, a broken quantisation),
and 01b keeps what it said. `screen_answers` reads the answers (raw_responses.jsonl records) and
says ok / warn / garbled, with the reasons and the first ids of each kind (to open with
scripts/inspect_samples.py --id):

  ended          share that end their turn (finish_reason "stop"), not cut by max_tokens
  malformed      share whose reasoning is not closed exactly once (mismatch.malformed_reason);
                 beside it, the share with the reasoning closed among those that opened it
  repetition     share in which a short token period repeats over a long span (a degenerate loop)
  non_printable  share with control characters or U+FFFD (undecodable bytes) in their text
  empty          share with nothing generated but the end of turn
  length         generated tokens: median, p95, max, and the share at max_tokens (reported only:
                 the `ended` check grades it)

Used by the pilot (eagle3_train/pilot) after its 01b, and by `eagle3-pilot --screen-only DIR`.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Iterable, Sequence

import numpy as np

from eagle3_train.common.mismatch import malformed_reason

OK, WARN, GARBLED = "ok", "warn", "garbled"
_RANK = {OK: 0, WARN: 1, GARBLED: 2}

# Thresholds, as (warn, garbled). A share past `warn` is worth opening a few answers; past
# `garbled` the answers are not worth training a draft on (the draft learns to predict them).
# A served reasoning model ends nearly every answer inside a generous --max-tokens; below 90% the
# budget cuts many (raise --max-tokens) or the end of turn never comes (a chat template or stop
# token that is not the model's); below 70% most training text is unfinished.
ENDED_MIN = (0.90, 0.70)
# A model closes its reasoning exactly once; more than 1 in 100 that do not points at a chat
# template or thinking mode that is not the model's own, 1 in 20 at a broken setup.
MALFORMED_MAX = (0.01, 0.05)
# A loop: a pattern of at most REPEAT_MAX_PERIOD tokens (about a sentence) repeated over at least
# REPEAT_MIN_SPAN tokens (4 repeats of that sentence, 128 of one token). Prose does not do that;
# a long table or generated data may, rarely, hence the 3% before a warning.
REPEAT_MAX_PERIOD = 32
REPEAT_MIN_SPAN = 128
REPEAT_MAX = (0.03, 0.10)
# Byte-level BPE decoded with the right tokenizer gives no U+FFFD except a character cut by
# max_tokens (not counted) and no control characters besides tab/newline/CR; their presence means
# a tokenizer that is not the server's, or a model emitting stray byte tokens.
NON_PRINTABLE_MAX = (0.01, 0.05)
# An answer with nothing but the end of turn is no training text; a few in a hundred is a server
# or template fault (an empty generation prompt, a stop string hit at once).
EMPTY_MAX = (0.01, 0.05)
EXAMPLES = 5  # ids listed per failing check


def periodic_span(ids: Sequence[int], max_period: int = REPEAT_MAX_PERIOD) -> tuple[int, int]:
    """(span, period): the longest stretch of `ids` made of at least two copies of a pattern of at
    most `max_period` tokens (span counts every copy), and that pattern's length; (0, 0) if none."""
    a = np.asarray(ids, dtype=np.int64)
    best = (0, 0)
    for p in range(1, min(max_period, len(a) // 2) + 1):
        same = np.concatenate(([False], a[p:] == a[:-p], [False]))
        edges = np.flatnonzero(same[1:] != same[:-1])  # run starts and ends, alternating
        if len(edges):
            run = int((edges[1::2] - edges[::2]).max())
            if run >= p and run + p > best[0]:  # run >= p: the pattern appears twice whole
                best = (run + p, p)
    return best


def non_printable(text: str, *, cut: bool = False) -> int:
    """Control characters (besides tab, newline, CR) and U+FFFD in `text`; `cut` (the answer was
    cut by max_tokens): a U+FFFD at the very end is a character cut in half, not counted."""
    if cut:
        text = text.rstrip("\ufffd")
    return sum(1 for ch in text if ch == "\ufffd" or (unicodedata.category(ch) == "Cc" and ch not in "\t\n\r"))


def _grade(value: float, bounds: tuple[float, float], *, higher_is_better: bool = False) -> str:
    warn, garbled = bounds
    if higher_is_better:
        return GARBLED if value < garbled else WARN if value < warn else OK
    return GARBLED if value > garbled else WARN if value > warn else OK


def _check(name: str, hits: list[str], n: int, bounds, why: str, *, invert: bool = False, **extra) -> dict:
    """One check: the share of the `n` answers in `hits` (or not in them, `invert`), graded."""
    share = (n - len(hits)) / n if invert else len(hits) / n
    verdict = _grade(share, bounds, higher_is_better=invert)
    return {"name": name, "share": round(share, 4), "count": len(hits), "verdict": verdict,
            "warn": bounds[0], "garbled": bounds[1], "bound": "min" if invert else "max", "why": why,
            "examples": hits[:EXAMPLES], **extra}


def screen_answers(records: Iterable[dict], fmt=None) -> dict:
    """The screen of 01b records (raw_responses.jsonl). `fmt` (a tokenization.ChatFormat) enables
    the reasoning checks; without it, or for a target that does not reason, they are skipped."""
    n = 0
    cut, repeats, odd, empty, malformed, lengths, max_tokens = [], [], [], [], [], [], set()
    reasons: dict[str, int] = {}
    opened = closed = 0
    worst_repeat = (0, 0, None)
    for rec in records:
        n += 1
        rid = str(rec.get("id"))
        gen = list(rec.get("token_ids") or [])
        finish = rec.get("finish_reason")
        lengths.append(len(gen))
        if (rec.get("sampling") or {}).get("max_tokens"):
            max_tokens.add(rec["sampling"]["max_tokens"])
        if finish != "stop":
            cut.append(rid)
        span, period = periodic_span(gen)
        if span >= REPEAT_MIN_SPAN:
            repeats.append(rid)
        if span > worst_repeat[0]:
            worst_repeat = (span, period, rid)
        text = (rec.get("reasoning") or "") + (rec.get("content") or "")
        if non_printable(text, cut=finish == "length"):
            odd.append(rid)
        if len(gen) <= (1 if finish == "stop" else 0):
            empty.append(rid)
        if fmt is not None and fmt.reasoning and rec.get("prompt_token_ids") is not None:
            prompt = list(rec["prompt_token_ids"])
            why = malformed_reason(fmt, prompt, gen, finish) if gen else None
            if why:
                malformed.append(rid)
                reasons[why] = reasons.get(why, 0) + 1
            mode = fmt.opens_thinking(prompt)
            if mode == "inside" or (mode == "before" and fmt.think_start_id in gen):
                opened += 1
                closed += gen.count(fmt.think_end_id) == 1
    if not n:
        return {"verdict": GARBLED, "answers": 0, "reasons": ["no answers to screen"], "checks": [], "length": {}}
    checks = [
        _check("ended", cut, n, ENDED_MIN, "share ending their turn (finish_reason stop); the rest were cut by "
               "max_tokens: raise --max-tokens, or the end of turn never comes (template/stop token)", invert=True),
        _check("repetition", repeats, n, REPEAT_MAX,
               f"share repeating a pattern of <= {REPEAT_MAX_PERIOD} tokens over >= {REPEAT_MIN_SPAN} tokens "
               "(a loop: sampling settings, a broken quantisation)",
               longest={"span": worst_repeat[0], "period": worst_repeat[1], "id": worst_repeat[2]}),
        _check("non_printable", odd, n, NON_PRINTABLE_MAX, "share with control characters or U+FFFD in the text "
               "(a tokenizer other than the server's, stray byte tokens)"),
        _check("empty", empty, n, EMPTY_MAX, "share with nothing generated but the end of turn"),
    ]
    if fmt is not None and fmt.reasoning:
        checks.insert(1, _check("malformed", malformed, n, MALFORMED_MAX,
                                "share whose reasoning is not closed exactly once (a template or thinking mode "
                                "that is not the model's)", kinds=reasons,
                                reasoning_closed=round(closed / opened, 4) if opened else None))
    lens = np.asarray(lengths)
    length = {"median": int(np.median(lens)), "p95": int(np.percentile(lens, 95)), "max": int(lens.max()),
              "at_max_tokens": round(len(cut) / n, 4), "max_tokens": sorted(max_tokens)}
    verdict = max((c["verdict"] for c in checks), key=_RANK.get)
    return {"verdict": verdict, "answers": n, "reasons": [_reason(c) for c in checks if c["verdict"] != OK],
            "checks": checks, "length": length}


def _reason(c: dict) -> str:
    limit = c["warn"] if c["verdict"] == WARN else c["garbled"]
    side = "below" if c["bound"] == "min" else "above"
    ids = f"; e.g. {', '.join(c['examples'])}" if c["examples"] and c["bound"] == "max" else ""
    return f"{c['name']} {c['share']:.1%} ({side} the {c['verdict']} bound {limit:.0%}): {c['why']}{ids}"


def format_screen(result: dict) -> str:
    """The screen as a few plain lines: one per check, the length figures, the verdict."""
    lines = [f"screen of {result['answers']} answers: {result['verdict'].upper()}"]
    for c in result["checks"]:
        low = c["bound"] == "min"
        bound = f"{'>=' if low else '<='} {c['warn']:.0%} (garbled {'<' if low else '>'} {c['garbled']:.0%})"
        extra = ""
        if c.get("reasoning_closed") is not None:
            extra = f"; reasoning closed in {c['reasoning_closed']:.1%} of those that opened it"
        if c["name"] == "repetition" and c["longest"]["span"]:
            lg = c["longest"]
            extra = f"; longest: {lg['span']} tokens of period {lg['period']} ({lg['id']})"
        lines.append(f"  {c['name']:<14} {c['share']:>7.1%}  ok {bound}  {c['verdict']}{extra}")
    ln = result["length"]
    if ln:
        lines.append(f"  {'length':<14} median {ln['median']}, p95 {ln['p95']}, max {ln['max']} tokens; "
                     f"{ln['at_max_tokens']:.1%} at max_tokens {ln['max_tokens'] or '?'}")
    lines += [f"  {result['verdict']}: {r}" for r in result["reasons"]]
    return "\n".join(lines)
