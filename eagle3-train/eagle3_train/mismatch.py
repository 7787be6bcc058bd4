"""Path (a) against path (b): where the returned ids and the re-wrapped text part ways, of which
kind, and how 01c reports it.

`tokenization.tokenize_sample` compares the two paths (`compare_ids`) and classifies a difference
(`classify_mismatch`); 01c (`dataset.build_training_set`) counts every one by kind and describes
the first few of each kind in full (`Tally`). Boundary whitespace (the reasoning parser stripped
it from the text) is expected and harmless; anything else is real and warned about.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

BOUNDARY_WHITESPACE, REAL = "boundary_whitespace", "real"
MISMATCH_CAUSES = {
    BOUNDARY_WHITESPACE: "whitespace at the reasoning/content boundary is in the returned ids but "
                         "not in the text: the server's reasoning parser strips it (vLLM's kimi_k2 "
                         "parser rstrips the reasoning); the returned ids are right and are used",
    REAL: "the returned ids differ from the re-wrapped text beyond boundary whitespace: a different "
          "tokenizer, chat template or think/end-of-turn token than the server's? the returned ids "
          "are used, but check these samples",
}
EXAMPLES = 5  # mismatches of each kind described in full in the manifest; all are counted


def compare_ids(a: Sequence[int], b: Sequence[int]) -> dict | None:
    """None if equal, else how many positions differ and the first one."""
    n = min(len(a), len(b))
    diff = [i for i in range(n) if a[i] != b[i]]
    count = len(diff) + abs(len(a) - len(b))
    if count == 0:
        return None
    return {"count": count, "first": diff[0] if diff else n, "len_ids": len(a), "len_text": len(b)}


def _with_boundary_space(text: str | None, said: str, trailing: bool) -> str | None | bool:
    """`text` extended by the whitespace that `said` (decoded from the ids) has beyond it on the
    boundary side; `text` itself if there is none; False if they differ by more than that."""
    base = text or ""
    if trailing:
        extra = said[len(base):] if said.startswith(base) else None
    else:
        extra = said[: len(said) - len(base)] if said.endswith(base) else None
    if extra is None or (extra and not extra.isspace()):
        return False
    if not extra:
        return text
    return base + extra if trailing else extra + base


def classify_mismatch(fmt, prompt: Sequence[int], gen: Sequence[int], text_prompt: Sequence[int],
                      reasoning: str | None, content: str | None, finish_reason: str | None) -> str:
    """BOUNDARY_WHITESPACE when the texts, given back the whitespace the returned ids hold at the
    end of the reasoning / start of the content, re-wrap (`fmt`, a tokenization.ChatFormat) to
    exactly the returned ids: then the text lost only that whitespace and the ids are right.
    Anything else is REAL."""
    if list(prompt) != list(text_prompt):
        return REAL
    mode = fmt.opens_thinking(prompt)
    if mode not in ("inside", "before"):
        return REAL
    gen = list(gen)
    start = 1 if mode == "before" and gen[:1] == [fmt.think_start_id] else 0
    end = gen.index(fmt.think_end_id, start) if fmt.think_end_id in gen[start:] else len(gen)
    stop = len(gen) - 1 if end < len(gen) and gen[-1:] == [fmt.end_of_turn_id] else len(gen)
    decode = fmt.tokenizer.decode
    r = _with_boundary_space(reasoning, decode(gen[start:end], skip_special_tokens=False), trailing=True)
    c = _with_boundary_space(content, decode(gen[end + 1: stop], skip_special_tokens=False), trailing=False)
    if r is False or c is False:
        return REAL
    return BOUNDARY_WHITESPACE if fmt.generated_ids(prompt, r, c, finish_reason) == gen else REAL


# ----------------------------------------------------------------------------- 01c's report

def _window(fmt, ids: list[int], at: int, width: int = 6) -> str:
    return fmt.tokenizer.decode(ids[max(0, at - width): at + width], skip_special_tokens=False)


def describe_mismatch(sample: dict, tok, fmt) -> dict:
    """Where the returned ids and the re-wrapped text part ways, decoded on both sides."""
    from .tokenization import tokenize_sample

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
    return f"{kinds.get(REAL, 0)} real, {kinds.get(BOUNDARY_WHITESPACE, 0)} boundary whitespace"


def report_lines(kinds: dict, examples: list[dict]) -> list[str]:
    """What 01c prints about mismatches: the expected kind as a note, real ones as a warning, then
    each described example, real ones first (they are the ones to read)."""
    lines = []
    if kinds.get(BOUNDARY_WHITESPACE):
        lines.append(f"  {kinds[BOUNDARY_WHITESPACE]} boundary-whitespace mismatches, expected: "
                     f"{MISMATCH_CAUSES[BOUNDARY_WHITESPACE]}")
    if kinds.get(REAL):
        lines.append(f"warning: {kinds[REAL]} real mismatches: {MISMATCH_CAUSES[REAL]}")
    for m in sorted(examples, key=lambda m: m.get("kind") != REAL):
        lines.append(f"  mismatch {m['id']} ({m.get('kind')}): {m['count']} positions differ from "
                     f"{m['first']} ({'prompt' if m['in_prompt'] else 'answer'}): ids {m['ids_side']!r} vs "
                     f"text {m['text_side']!r}")
    return lines
