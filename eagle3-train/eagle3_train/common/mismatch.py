"""Path (a) against path (b): where the returned ids and the re-wrapped text part ways, and of
which kind.

`tokenization.tokenize_sample` compares the two paths (`compare_ids`) and classifies a difference
(`classify_mismatch`); 01c counts every one by kind and describes the first few of each kind in
full (tokenize/report.py). Boundary whitespace (the reasoning parser stripped
it from the text) is expected and harmless; anything else is real and warned about.
"""

from __future__ import annotations

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
