"""Path (a) against path (b): where the returned ids and the re-wrapped text part ways, and of
which kind.

`tokenization.tokenize_sample` compares the two paths (`compare_ids`) and classifies a difference
(`classify_mismatch`); 01c counts every one by kind and describes the first few of each kind in
full (tokenize/report.py). The kinds, from 2,000 real answers of a reasoning target served by
vLLM, where 01c once warned of 143 "real" mismatches and none was a tokenizer or template error:
boundary whitespace (the reasoning parser stripped it from the text), the same text split into
other tokens (the model emitted a non-canonical tokenization, or a degenerate repeat cut by
max_tokens), and a malformed answer (end of turn with the reasoning never closed, several
reasoning ends), where the re-wrap adds or drops a think token. The first two are harmless; the
third is counted as an answer-quality figure; only what is left is real and warned about.
"""

from __future__ import annotations

from collections.abc import Sequence

BOUNDARY_WHITESPACE, SAME_TEXT, MALFORMED, REAL = "boundary_whitespace", "same_text", "malformed", "real"
MISMATCH_CAUSES = {
    BOUNDARY_WHITESPACE: "whitespace at the reasoning/content boundary is in the returned ids but "
                         "not in the text: the server's reasoning parser strips it (vLLM's kimi_k2 "
                         "parser rstrips the reasoning); the returned ids are right and are used",
    SAME_TEXT: "the returned ids decode to the same text as the re-wrap but split into other tokens: "
               "the model emitted a non-canonical tokenization (or a degenerate repeat cut by max_tokens); "
               "the returned ids are what it said and are used",
    MALFORMED: "the model left the answer malformed (end of turn with the reasoning never closed, or "
               "several reasoning ends), so the re-wrap adds or drops a think token; the returned ids are "
               "used: an answer-quality figure, not a tokenizer error",
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


def malformed_reason(fmt, prompt: Sequence[int], gen: Sequence[int], finish_reason: str | None) -> str | None:
    """Why the generated ids (`fmt`, a tokenization.ChatFormat) are not a well-formed reasoning
    answer, or None: several reasoning ends, a reasoning opened twice, or an end of turn with the
    reasoning still open. A cut by max_tokens inside the reasoning is not malformed."""
    mode = fmt.opens_thinking(prompt)
    if mode not in ("inside", "before"):
        return None
    gen = list(gen)
    starts, ends = gen.count(fmt.think_start_id), gen.count(fmt.think_end_id)
    if ends > 1:
        return f"{ends} reasoning ends"
    if starts > (1 if mode == "before" else 0):
        return "reasoning opened again"
    opened = mode == "inside" or starts == 1
    if opened and ends == 0 and finish_reason != "length" and gen[-1:] == [fmt.end_of_turn_id]:
        return "end of turn with the reasoning never closed"
    return None


def classify_mismatch(fmt, prompt: Sequence[int], gen: Sequence[int], text_prompt: Sequence[int],
                      reasoning: str | None, content: str | None, finish_reason: str | None) -> str:
    """The kind of a difference between the returned ids and the re-wrapped texts (`fmt`, a
    tokenization.ChatFormat). MALFORMED when the answer itself is (malformed_reason);
    BOUNDARY_WHITESPACE when the texts, given back the whitespace the returned ids hold at the end
    of the reasoning / start of the content, re-wrap to exactly the returned ids; SAME_TEXT when
    the re-wrap (with that whitespace, where it applies) decodes to the same characters as the
    returned ids; anything else (a prompt difference included) is REAL."""
    if list(prompt) != list(text_prompt):
        return REAL
    gen = list(gen)
    if malformed_reason(fmt, prompt, gen, finish_reason):
        return MALFORMED
    decode = fmt.tokenizer.decode
    mode = fmt.opens_thinking(prompt)
    if mode in ("inside", "before"):
        start = 1 if mode == "before" and gen[:1] == [fmt.think_start_id] else 0
        end = gen.index(fmt.think_end_id, start) if fmt.think_end_id in gen[start:] else len(gen)
        stop = len(gen) - 1 if end < len(gen) and gen[-1:] == [fmt.end_of_turn_id] else len(gen)
        r = _with_boundary_space(reasoning, decode(gen[start:end], skip_special_tokens=False), trailing=True)
        c = _with_boundary_space(content, decode(gen[end + 1: stop], skip_special_tokens=False), trailing=False)
        if r is not False and c is not False:
            if fmt.generated_ids(prompt, r, c, finish_reason) == gen:
                return BOUNDARY_WHITESPACE
            reasoning, content = r, c
    rebuilt = fmt.generated_ids(prompt, reasoning, content, finish_reason)
    same = decode(rebuilt, skip_special_tokens=False) == decode(gen, skip_special_tokens=False)
    return SAME_TEXT if same else REAL
