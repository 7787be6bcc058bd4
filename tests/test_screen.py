"""The garbled-output screen (common/screen.py) on hand-made 01b records: a clean set is ok, and
each kind of garbling is named, at the warn and the garbled level."""

from __future__ import annotations

import random

import pytest
from eagle3_train.common.screen import (
    GARBLED,
    OK,
    REPEAT_MIN_SPAN,
    WARN,
    format_screen,
    non_printable,
    periodic_span,
    screen_answers,
)
from eagle3_train.common.tokenization import ChatFormat

BOS, EOT, THINK, END_THINK = 1, 2, 7, 8
# The ids a K2.5-style template uses: the generation prompt opens <think> ("inside").
FMT = ChatFormat(None, reasoning=True, think_start_id=THINK, think_end_id=END_THINK, end_of_turn_id=EOT)
PROMPT = [BOS, 30, 31, 32, THINK]


def words(seed: int, n: int) -> list[int]:
    """n seeded random ids in 100..499: text with no long repeat."""
    rng = random.Random(seed)
    return [rng.randrange(100, 500) for _ in range(n)]


def answer(i: int, *, gen=None, finish="stop", reasoning="thinking it over", content="The answer is 4.") -> dict:
    if gen is None:
        gen = words(i, 40) + [END_THINK] + words(i + 1000, 20) + [EOT]
    return {"id": f"q{i:03d}", "messages": [{"role": "user", "content": "2+2?"}], "reasoning": reasoning,
            "content": content, "prompt_token_ids": PROMPT, "token_ids": gen, "finish_reason": finish,
            "sampling": {"max_tokens": 64}}


def clean(n: int = 40) -> list[dict]:
    return [answer(i) for i in range(n)]


def check(result: dict, name: str) -> dict:
    return next(c for c in result["checks"] if c["name"] == name)


def test_a_clean_set_is_ok():
    r = screen_answers(clean(), FMT)
    assert r["verdict"] == OK and r["reasons"] == [] and r["answers"] == 40
    assert {c["name"] for c in r["checks"]} == {"ended", "malformed", "repetition", "non_printable", "empty"}
    assert check(r, "malformed")["reasoning_closed"] == 1.0
    assert r["length"] == {"median": 62, "p95": 62, "max": 62, "at_max_tokens": 0.0, "max_tokens": [64]}
    assert "screen of 40 answers: OK" in format_screen(r)


def _with(bad: list[dict], n: int = 40) -> list[dict]:
    """A clean set of n answers whose first len(bad) are replaced by `bad`."""
    return bad + clean(n)[len(bad):]


# (check, its bad answers (the first k of 40): 1 = 2.5%, 2 = 5%, 6 = 15%)
def cut(i):
    return answer(i, gen=words(i, 64), finish="length", content=None)


def malformed_two_ends(i):
    return answer(i, gen=words(i, 10) + [END_THINK] + words(i, 5) + [END_THINK] + [EOT])


def malformed_never_closed(i):
    return answer(i, gen=words(i, 30) + [EOT], content=None)


def loop(i):
    return answer(i, gen=words(i, 10) + [11, 12, 13, 14] * (REPEAT_MIN_SPAN // 4 + 1), finish="length")


def control_chars(i):
    return answer(i, content="The answer is \x07\x1b[0m 4.")


def replacement_char(i):
    return answer(i, reasoning="think \ufffd\ufffd it over")


def empty(i):
    return answer(i, gen=[EOT], reasoning=None, content="")


@pytest.mark.parametrize("name,make,k,verdict", [
    ("ended", cut, 6, WARN),             # 85% ended: below 90%
    ("ended", cut, 14, GARBLED),         # 65%: below 70%
    ("malformed", malformed_two_ends, 1, WARN),
    ("malformed", malformed_never_closed, 3, GARBLED),
    ("repetition", loop, 2, WARN),       # 5%: above 3%
    ("repetition", loop, 6, GARBLED),
    ("non_printable", control_chars, 1, WARN),
    ("non_printable", replacement_char, 3, GARBLED),
    ("empty", empty, 1, WARN),
    ("empty", empty, 3, GARBLED),
])
def test_each_kind_of_garbling_is_named(name, make, k, verdict):
    r = screen_answers(_with([make(i) for i in range(k)]), FMT)
    c = check(r, name)
    assert c["verdict"] == verdict and c["count"] == k  # the answers at fault
    assert r["verdict"] == verdict
    assert any(reason.startswith(name) for reason in r["reasons"]), r["reasons"]
    assert c["examples"] == [f"q{i:03d}" for i in range(min(k, 5))]


def test_the_kind_of_malformed_answer_is_counted():
    r = screen_answers(_with([malformed_two_ends(0), malformed_never_closed(1)]), FMT)
    c = check(r, "malformed")
    assert c["kinds"] == {"2 reasoning ends": 1, "end of turn with the reasoning never closed": 1}
    assert c["reasoning_closed"] == 38 / 40


def test_a_cut_inside_the_reasoning_is_not_malformed_but_not_ended():
    r = screen_answers(_with([cut(0)]), FMT)
    assert check(r, "malformed")["count"] == 0 and check(r, "ended")["count"] == 1
    assert r["length"]["at_max_tokens"] == 0.025


def test_without_a_chat_format_the_reasoning_check_is_skipped():
    r = screen_answers(_with([malformed_two_ends(0)]), None)
    assert "malformed" not in {c["name"] for c in r["checks"]} and r["verdict"] == OK


def test_no_answers_is_garbled():
    assert screen_answers([], FMT)["verdict"] == GARBLED


def test_periodic_span():
    assert periodic_span([1, 2, 3] * 10) == (30, 3)
    assert periodic_span(list(range(100, 300))) == (0, 0)
    assert periodic_span(words(0, 2000))[0] < 8  # random text: chance pairs, no loop
    assert periodic_span([9, 5, 5, 5, 5, 4]) == (4, 1)
    assert periodic_span([9, 1, 2, 3, 1, 2, 8]) == (0, 0)  # one copy and a part is no repeat


def test_non_printable():
    assert non_printable("tab\tnewline\nok") == 0
    assert non_printable("bell\x07 and \ufffd") == 2
    assert non_printable("cut in half \ufffd", cut=True) == 0
    assert non_printable("cut in half \ufffd") == 1
