"""An answer without token ids (SGLang, a hosted API) given ids re-wrapped from its text, and the
warning every such answer carries: 01a imports whole files of them, 01b keeps one with
--allow-text-fallback. The ids come from the one tokenization module's re-wrap (`ChatFormat.rewrap`);
every such record says `source: "text"`, so a text-derived set never passes for one the server
tokenized."""

from __future__ import annotations

TEXT_WARNING = ("text cannot restore the exact tokenization the target chose, whitespace its reasoning "
                "parser stripped (e.g. a newline before </think>), or special tokens written inside "
                "the text; a server that returns token ids gives exact data")


def text_answer(fmt, messages: list[dict], answer: dict) -> dict:
    """`answer` (reasoning, content, finish_reason, ...) with ids re-wrapped from its texts."""
    prompt, gen = fmt.rewrap(messages, answer.get("reasoning"), answer.get("content"),
                             answer.get("finish_reason") or "stop")
    return {**answer, "prompt_token_ids": prompt, "token_ids": gen, "source": "text"}


def has_special_text(fmt, *texts: str | None) -> bool:
    """A special token's string inside the text: it encodes as that token, whatever the target wrote."""
    specials = [t for t in getattr(fmt.tokenizer, "all_special_tokens", []) if t]
    return any(s in t for t in texts if t for s in specials)


def text_warning(n: int, total: int, with_specials: int | None = None) -> str:
    specials = "" if with_specials is None else f" ({with_specials} with special-token strings in their text)"
    return f"warning: {n} of {total} answers have text-derived ids{specials}: {TEXT_WARNING}"
