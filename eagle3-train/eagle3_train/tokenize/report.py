"""01c's mismatch report: every mismatch counted by kind, the first few of each kind described in
full (decoded on both sides), real ones warned about and listed first."""

from __future__ import annotations

from collections import Counter

from eagle3_train.common.mismatch import BOUNDARY_WHITESPACE, MALFORMED, MISMATCH_CAUSES, REAL, SAME_TEXT
from eagle3_train.common.tokenization import tokenize_sample

EXAMPLES = 5  # mismatches of each kind described in full in the manifest; all are counted


def _window(fmt, ids: list[int], at: int, width: int = 6) -> str:
    return fmt.tokenizer.decode(ids[max(0, at - width): at + width], skip_special_tokens=False)


def describe_mismatch(sample: dict, tok, fmt) -> dict:
    """Where the returned ids and the re-wrapped text part ways, decoded on both sides."""
    text_only = tokenize_sample({**sample, "prompt_token_ids": None, "token_ids": None}, fmt)
    at = tok.mismatch["first"]
    return {"id": sample["id"], **tok.mismatch, "cause": MISMATCH_CAUSES[tok.mismatch["kind"]],
            "in_prompt": at < tok.prompt_len,
            "ids_side": _window(fmt, tok.input_ids, at), "text_side": _window(fmt, text_only.input_ids, at)}


class Tally:
    """Every mismatch counted by kind; the first EXAMPLES of each kind described in full."""

    def __init__(self):
        self.kinds: Counter = Counter()
        self.examples: list[dict] = []

    def add(self, sample: dict, tok, fmt) -> None:
        """`tok` is the tokenization.Tokenized of `sample`, with a mismatch."""
        kind = tok.mismatch["kind"]
        self.kinds[kind] += 1
        if self.kinds[kind] <= EXAMPLES:
            self.examples.append(describe_mismatch(sample, tok, fmt))

    def manifest_fields(self) -> dict:
        return {"mismatch_examples": self.examples,
                "mismatch_causes": {k: MISMATCH_CAUSES[k] for k in self.kinds}}


def summary_by_kind(kinds: dict) -> str:
    """The counts' parenthesis in 01c's summary line."""
    return (f"{kinds.get(REAL, 0)} real, {kinds.get(BOUNDARY_WHITESPACE, 0)} boundary whitespace, "
            f"{kinds.get(SAME_TEXT, 0)} same text split otherwise, {kinds.get(MALFORMED, 0)} malformed answer")


def report_lines(kinds: dict, examples: list[dict]) -> list[str]:
    """What 01c prints about mismatches: the explained kinds as notes, real ones as a warning, then
    each described example, real ones first (they are the ones to read)."""
    lines = []
    for kind, what in ((BOUNDARY_WHITESPACE, "boundary-whitespace"), (SAME_TEXT, "same-text"),
                       (MALFORMED, "malformed-answer")):
        if kinds.get(kind):
            lines.append(f"  {kinds[kind]} {what} mismatches, explained: {MISMATCH_CAUSES[kind]}")
    if kinds.get(REAL):
        lines.append(f"warning: {kinds[REAL]} real mismatches: {MISMATCH_CAUSES[REAL]}")
    for m in sorted(examples, key=lambda m: m.get("kind") != REAL):
        lines.append(f"  mismatch {m['id']} ({m.get('kind')}): {m['count']} positions differ from "
                     f"{m['first']} ({'prompt' if m['in_prompt'] else 'answer'}): ids {m['ids_side']!r} vs "
                     f"text {m['text_side']!r}")
    return lines
