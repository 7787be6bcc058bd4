"""The one tokenization module: invariants on both template families, with property-based tests."""

from __future__ import annotations

import pytest
from eagle3_testkit.tiny import synthetic_examples
from eagle3_train.common.errors import PipelineError
from eagle3_train.common.mismatch import BOUNDARY_WHITESPACE, MALFORMED, REAL, SAME_TEXT, compare_ids, malformed_reason
from eagle3_train.common.tokenization import ChatFormat, tokenize_sample
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
# Text the tiny byte-level tokenizer must carry exactly; no special-token strings inside it.
plain_text = st.text(st.characters(codec="utf-8", exclude_characters="<>|"), min_size=0, max_size=80)
# ...and the target's own kind of text, where the BPE merges apply (random text seldom meets them).
task_text = st.sampled_from([t for ex in synthetic_examples(30, seed=9) for t in (ex["reasoning"], ex["answer"])])
any_text = st.one_of(plain_text, task_text)


@pytest.fixture(scope="module")
def k25(k25_tokenizer):
    return ChatFormat.from_tokenizer(k25_tokenizer)


@pytest.fixture(scope="module")
def thinking_first(thinking_first_tokenizer):
    return ChatFormat.from_tokenizer(thinking_first_tokenizer)


def ids(tok, *tokens):
    return [tok.convert_tokens_to_ids(t) for t in tokens]


def emitted(fmt, reasoning, content):
    """What the target itself would emit after the generation prompt (path (a)'s token_ids)."""
    tok = fmt.tokenizer
    prompt = fmt.render([{"role": "user", "content": "q"}], add_generation_prompt=True)
    gen = [] if prompt[-1] == fmt.think_start_id else [fmt.think_start_id]
    gen += tok.encode(reasoning, add_special_tokens=False) + [fmt.think_end_id]
    gen += tok.encode(content, add_special_tokens=False) + [fmt.end_of_turn_id]
    return prompt, gen


def test_ids_are_looked_up_by_string_not_hard_coded(k25, k25_tokenizer):
    assert k25.think_start_id == k25_tokenizer.convert_tokens_to_ids("<think>")
    assert k25.think_end_id == k25_tokenizer.convert_tokens_to_ids("</think>")
    assert k25.end_of_turn_id == k25_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert k25.think_start_id != 163606  # tiny vocab: a hard-coded Kimi id could not be right here


def test_template_family_is_detected_from_the_rendered_prompt(k25, thinking_first):
    msgs = [{"role": "user", "content": "What is 2 + 2?"}]
    assert k25.opens_thinking(k25.render(msgs, add_generation_prompt=True)) == "inside"
    assert thinking_first.opens_thinking(thinking_first.render(msgs, add_generation_prompt=True)) == "before"
    off = ChatFormat.from_tokenizer(k25.tokenizer, chat_template_kwargs={"thinking": False})
    assert off.opens_thinking(off.render(msgs, add_generation_prompt=True)) == "closed"


def test_k25_generated_part_is_reasoning_think_end_content_im_end(k25):
    tok = k25.tokenizer
    sample = {"id": "s", "messages": [{"role": "user", "content": "hi"}],
              "reasoning": "step one.", "content": "done."}
    t = tokenize_sample(sample, k25)
    gen = t.input_ids[t.prompt_len:]
    assert gen == (tok.encode("step one.", add_special_tokens=False) + ids(tok, "</think>")
                   + tok.encode("done.", add_special_tokens=False) + ids(tok, "<|im_end|>"))
    assert t.input_ids[t.prompt_len - 1] == k25.think_start_id  # <think> belongs to the prompt
    assert t.loss_mask == [0] * t.prompt_len + [1] * len(gen)


def test_thinking_first_generated_part_starts_with_think(thinking_first):
    sample = {"id": "s", "messages": [{"role": "user", "content": "hi"}], "reasoning": "r", "content": "c"}
    t = tokenize_sample(sample, thinking_first)
    gen = t.input_ids[t.prompt_len:]
    assert gen[0] == thinking_first.think_start_id
    assert gen.count(thinking_first.think_end_id) == 1 and gen[-1] == thinking_first.end_of_turn_id


@pytest.mark.parametrize("reasoning", [None, ""])
def test_empty_or_missing_reasoning_still_closes_thinking(k25, reasoning):
    sample = {"id": "s", "messages": [{"role": "user", "content": "hi"}], "reasoning": reasoning, "content": "c"}
    t = tokenize_sample(sample, k25)
    gen = t.input_ids[t.prompt_len:]
    assert gen[0] == k25.think_end_id


def test_thinking_switched_off_has_no_think_tokens_in_the_answer(k25_tokenizer):
    fmt = ChatFormat.from_tokenizer(k25_tokenizer, chat_template_kwargs={"thinking": False})
    t = tokenize_sample({"id": "s", "messages": [{"role": "user", "content": "hi"}], "content": "c"}, fmt)
    gen = t.input_ids[t.prompt_len:]
    assert fmt.think_start_id not in gen and fmt.think_end_id not in gen


def test_non_reasoning_model(k25_tokenizer):
    fmt = ChatFormat.from_tokenizer(k25_tokenizer, reasoning=False)
    t = tokenize_sample({"id": "s", "messages": [{"role": "user", "content": "hi"}], "content": "c"}, fmt)
    assert t.input_ids[t.prompt_len:][-1] == fmt.end_of_turn_id


def test_tokenizer_without_think_tokens_is_a_clear_error(k25_tokenizer, monkeypatch):
    class NoThink:
        def __init__(self, tok):
            self._tok = tok

        def __getattr__(self, name):
            return getattr(self._tok, name)

        def __len__(self):
            return len(self._tok)

        def convert_tokens_to_ids(self, t):
            return None if t in ("<think>", "</think>") else self._tok.convert_tokens_to_ids(t)

    with pytest.raises(PipelineError, match="--think-start-id.*--no-reasoning"):
        ChatFormat.from_tokenizer(NoThink(k25_tokenizer))
    # ...unless the ids are given, or the user says the model does not reason.
    ChatFormat.from_tokenizer(NoThink(k25_tokenizer), think_start_id=7, think_end_id=8)
    ChatFormat.from_tokenizer(NoThink(k25_tokenizer), reasoning=False)


def test_override_ids_out_of_vocab_rejected(k25_tokenizer):
    with pytest.raises(PipelineError, match="outside the tokenizer's vocabulary"):
        ChatFormat.from_tokenizer(k25_tokenizer, think_end_id=10**6)


def test_ids_from_another_tokenizer_are_rejected(k25):
    sample = {"id": "x", "messages": [{"role": "user", "content": "hi"}],
              "prompt_token_ids": [1, 2, 3], "token_ids": [5, 163607, 2]}
    with pytest.raises(PipelineError, match="sample x: token_ids has token id 163607 outside"):
        tokenize_sample(sample, k25)


def test_empty_messages_rejected(k25):
    with pytest.raises(PipelineError, match="no prompt messages"):
        tokenize_sample({"id": "e", "messages": [], "content": "c"}, k25)


def test_truncation_is_counted(k25):
    sample = {"id": "s", "messages": [{"role": "user", "content": "hi"}], "reasoning": "a b c d e f",
              "content": "g h"}
    full = tokenize_sample(sample, k25)
    cut = tokenize_sample(sample, k25, max_seq_len=len(full.input_ids) - 5)
    assert cut.num_truncated == 5
    assert cut.input_ids == full.input_ids[:-5] and cut.loss_mask == full.loss_mask[:-5]


def test_finish_reason_length_has_no_end_of_turn_and_open_reasoning(k25):
    sample = {"id": "s", "messages": [{"role": "user", "content": "hi"}], "reasoning": "cut off",
              "content": None, "finish_reason": "length"}
    gen = tokenize_sample(sample, k25).input_ids
    assert k25.think_end_id not in gen[-3:] and gen[-1] != k25.end_of_turn_id


def test_mismatch_between_ids_and_text_is_reported_not_hidden(k25):
    prompt, gen = emitted(k25, "abc", "def")
    sample = {"id": "s", "messages": [{"role": "user", "content": "q"}], "prompt_token_ids": prompt,
              "token_ids": gen, "reasoning": "abX", "content": "def"}
    t = tokenize_sample(sample, k25)
    assert t.source == "token_ids" and t.input_ids == prompt + gen  # built from (a)...
    assert t.mismatch is not None and t.mismatch["first"] >= len(prompt)  # ...(b) disagreement reported


def returned(fmt, said_reasoning, said_content, **texts):
    """A sample whose ids the target emitted for `said_*`, with the texts a server's parser handed
    back (`reasoning=`, `content=`; default: the same texts)."""
    prompt, gen = emitted(fmt, said_reasoning, said_content)
    return {"id": "s", "messages": [{"role": "user", "content": "q"}], "prompt_token_ids": prompt,
            "token_ids": gen, "reasoning": texts.get("reasoning", said_reasoning),
            "content": texts.get("content", said_content)}


@pytest.mark.parametrize("tail", ["\n", "\n\n", " \n\t"])
def test_whitespace_stripped_from_the_reasoning_is_a_boundary_mismatch(k25, thinking_first, tail):
    # vLLM's kimi_k2 parser rstrips the reasoning; the returned ids keep the whitespace.
    for fmt in (k25, thinking_first):
        t = tokenize_sample(returned(fmt, "I found 2." + tail, "2 times.", reasoning="I found 2."), fmt)
        assert t.mismatch is not None and t.mismatch["kind"] == BOUNDARY_WHITESPACE
        assert t.input_ids[t.prompt_len:] == emitted(fmt, "I found 2." + tail, "2 times.")[1]  # ids kept


def test_whitespace_only_reasoning_returned_as_none_and_content_lstrip_are_boundary(k25):
    assert tokenize_sample(returned(k25, "\n", "c", reasoning=None), k25).mismatch["kind"] == BOUNDARY_WHITESPACE
    assert tokenize_sample(returned(k25, "r", "\n\nc", content="c"), k25).mismatch["kind"] == BOUNDARY_WHITESPACE


def test_a_length_cut_reasoning_that_lost_trailing_whitespace_is_boundary(k25):
    prompt = k25.render([{"role": "user", "content": "q"}], add_generation_prompt=True)
    gen = k25.encode("thinking hard \n")
    sample = {"id": "s", "messages": [{"role": "user", "content": "q"}], "prompt_token_ids": prompt,
              "token_ids": gen, "reasoning": "thinking hard", "content": None, "finish_reason": "length"}
    assert tokenize_sample(sample, k25).mismatch["kind"] == BOUNDARY_WHITESPACE


@pytest.mark.parametrize("texts", [
    {"reasoning": "I found 3."},                      # another word, not whitespace
    {"reasoning": "I found 2.\n\n"},                  # more whitespace in the text than in the ids
    {"reasoning": "I found 2", "content": "2 times"},  # whitespace and more
    {"content": " 2 times."},                         # whitespace the ids do not have
])
def test_anything_beyond_stripped_boundary_whitespace_is_real(k25, texts):
    t = tokenize_sample(returned(k25, "I found 2.\n", "2 times.", **texts), k25)
    assert t.mismatch is not None and t.mismatch["kind"] == REAL


def test_a_prompt_difference_is_real_even_with_boundary_whitespace(k25):
    sample = returned(k25, "r\n", "c", reasoning="r")
    sample["prompt_token_ids"] = sample["prompt_token_ids"][:-2] + sample["prompt_token_ids"][-1:]
    assert tokenize_sample(sample, k25).mismatch["kind"] == REAL


# Qwen3-like: <|im_start|>-style turns with a newline after the role; thinking off renders an
# empty, closed think block followed by blank lines (built here with the tiny tokenizer's tokens).
QWEN3_LIKE_TEMPLATE = (
    "{%- for m in messages -%}<|im_user|>{{ m['role'] }}{{ '\n' }}{{ m['content'] }}<|im_end|>{{ '\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant{{ '\n' }}"
    "{%- if enable_thinking is defined and not enable_thinking -%}<think>{{ '\n\n' }}</think>{{ '\n\n' }}"
    "{%- endif -%}{%- endif -%}")


@pytest.fixture(scope="module")
def qwen3_like(k25_tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(k25_tokenizer_dir)
    tok.chat_template = QWEN3_LIKE_TEMPLATE
    return tok


def test_qwen3_thinking_off_prompt_is_read_as_closed(qwen3_like):
    msgs = [{"role": "user", "content": "hi"}]
    off = ChatFormat.from_tokenizer(qwen3_like, chat_template_kwargs={"enable_thinking": False})
    prompt = off.render(msgs, add_generation_prompt=True)
    assert qwen3_like.decode(prompt).endswith("assistant\n<think>\n\n</think>\n\n")
    assert prompt[-1] != off.think_end_id  # the prompt does not end on </think>: blank lines follow it
    assert off.opens_thinking(prompt) == "closed"
    t = tokenize_sample({"id": "s", "messages": msgs, "content": "hello"}, off)
    end = ids(qwen3_like, "<|im_end|>")
    assert t.input_ids[t.prompt_len:] == qwen3_like.encode("hello", add_special_tokens=False) + end
    on = ChatFormat.from_tokenizer(qwen3_like)
    assert on.opens_thinking(on.render(msgs, add_generation_prompt=True)) == "before"


def test_earlier_turns_think_tokens_do_not_decide_the_generation_prompt(k25, thinking_first):
    # K2.5 renders an earlier assistant turn as <think></think>...: only what follows the last
    # end-of-turn (the generation prompt) counts.
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    assert k25.opens_thinking(k25.render(msgs, add_generation_prompt=True)) == "inside"
    assert thinking_first.opens_thinking(thinking_first.render(msgs, add_generation_prompt=True)) == "before"


def test_rewrap_is_prompt_plus_think_reasoning_think_end_content_end_of_turn(thinking_first):
    msgs = [{"role": "user", "content": "q"}]
    prompt, gen = thinking_first.rewrap(msgs, "r", "c")
    assert (prompt, gen) == by_hand(thinking_first, "q", "r", "c")


def test_compare_ids():
    assert compare_ids([1, 2, 3], [1, 2, 3]) is None
    assert compare_ids([1, 2, 3], [1, 9, 3]) == {"count": 1, "first": 1, "len_ids": 3, "len_text": 3}
    assert compare_ids([1, 2], [1, 2, 3, 4])["count"] == 2


def test_multi_turn_final_only_by_default_and_all_on_request(k25):
    msgs = [{"role": "user", "content": "first"}, {"role": "assistant", "content": "one", "reasoning": "hidden"},
            {"role": "user", "content": "second"}]
    sample = {"id": "m", "messages": msgs, "reasoning": "r2", "content": "two"}
    final = tokenize_sample(sample, k25)
    every = tokenize_sample(sample, k25, loss_on="all")
    assert final.input_ids == every.input_ids
    extra = [i for i, (a, b) in enumerate(zip(final.loss_mask, every.loss_mask)) if a != b]
    assert extra, "the earlier assistant turn must be supervised with --loss-on all"
    tok = k25.tokenizer
    # The earlier turn is rendered by the template with its reasoning dropped (K2.5 behaviour).
    assert tok.decode([every.input_ids[i] for i in extra]) == "</think>one<|im_end|>"
    assert "hidden" not in tok.decode(final.input_ids)


def by_hand(fmt, question, reasoning, content):
    """Path (a) ids built without the module: the template rendered by the tokenizer itself, then
    each piece encoded on its own and the special ids looked up by string, as the target emits them."""
    tok = fmt.tokenizer
    prompt = list(tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False))
    think, think_end, eot = ids(tok, "<think>", "</think>", "<|im_end|>")
    gen = [] if prompt[-1] == think else [think]
    gen += tok.encode(reasoning, add_special_tokens=False) + [think_end]
    return prompt, gen + tok.encode(content, add_special_tokens=False) + [eot]


@SETTINGS
@given(reasoning=any_text, content=any_text, question=any_text.filter(lambda s: s.strip()))
def test_property_paths_agree_and_mask_covers_exactly_the_generation(k25, thinking_first, reasoning, content, question):
    for fmt in (k25, thinking_first):
        tok = fmt.tokenizer
        msgs = [{"role": "user", "content": question}]
        prompt, gen = by_hand(fmt, question, reasoning, content)
        by_text = tokenize_sample({"id": "p", "messages": msgs, "reasoning": reasoning, "content": content}, fmt)
        by_ids = tokenize_sample({"id": "p", "messages": msgs, "prompt_token_ids": prompt, "token_ids": gen,
                                  "reasoning": reasoning, "content": content}, fmt)
        assert by_text.input_ids == prompt + gen, "path (b) must rebuild what the target emitted"
        assert by_ids.mismatch is None and by_ids.input_ids == prompt + gen and by_ids.source == "token_ids"
        assert by_text.source == "text"
        assert len(by_text.loss_mask) == len(by_text.input_ids)
        assert by_text.loss_mask == [0] * len(prompt) + [1] * len(gen)
        # The masked span decodes to the generated text with the think tokens exactly in place.
        masked = [t for t, m in zip(by_text.input_ids, by_text.loss_mask) if m]
        opener = "" if prompt[-1] == fmt.think_start_id else "<think>"
        assert tok.decode(masked) == f"{opener}{reasoning}</think>{content}<|im_end|>"
        assert masked.count(fmt.think_end_id) == 1


def spelled(fmt, text):
    """`text` as the model may emit it: character by character, not the tokenizer's canonical split."""
    return [i for ch in text for i in fmt.encode(ch)]


def test_the_same_text_split_into_other_tokens_is_its_own_kind(k25):
    # Real answers hold non-canonical splits of the same characters (e.g. "elaeb") and degenerate
    # repeats cut by max_tokens; the ids are what the model said, nothing is wrong with the tokenizer.
    for fmt in (k25,):
        prompt, canonical = emitted(fmt, "the word elaeb has 5 letters", "5")
        word = fmt.encode("the word elaeb has 5 letters")
        odd = spelled(fmt, "the word elaeb has 5 letters")
        assert odd != word and fmt.tokenizer.decode(odd) == fmt.tokenizer.decode(word)
        gen = odd + canonical[len(word):]
        sample = {"id": "s", "messages": [{"role": "user", "content": "q"}], "prompt_token_ids": prompt,
                  "token_ids": gen, "reasoning": "the word elaeb has 5 letters", "content": "5"}
        t = tokenize_sample(sample, fmt)
        assert t.mismatch["kind"] == SAME_TEXT and t.input_ids[t.prompt_len:] == gen and t.malformed is None
    # A repeat cut by max_tokens, with the parser's stripped whitespace on top: still the same text.
    repeat = spelled(k25, "dddddddd") + k25.encode(" \n")
    sample = {"id": "r", "messages": [{"role": "user", "content": "q"}], "prompt_token_ids": prompt,
              "token_ids": repeat, "reasoning": "dddddddd", "content": None, "finish_reason": "length"}
    assert tokenize_sample(sample, k25).mismatch["kind"] == SAME_TEXT


def test_other_characters_split_otherwise_are_still_real(k25):
    prompt, canonical = emitted(k25, "abc", "def")
    sample = {"id": "s", "messages": [{"role": "user", "content": "q"}], "prompt_token_ids": prompt,
              "token_ids": spelled(k25, "abd") + canonical[len(k25.encode("abc")):], "reasoning": "abc",
              "content": "def"}
    assert tokenize_sample(sample, k25).mismatch["kind"] == REAL


@pytest.mark.parametrize("case", ["never_closed", "two_ends", "two_ends_in_text", "reopened"])
def test_a_malformed_answer_is_its_own_kind_and_counted(k25, case):
    prompt, gen = emitted(k25, "thinking", "the answer")
    end, eot, start = k25.think_end_id, k25.end_of_turn_id, k25.think_start_id
    reasoning, content = "thinking", "the answer"
    if case == "never_closed":  # <|im_end|> with the reasoning still open: the parser returns it all as reasoning
        gen = k25.encode("thinking and the answer") + [eot]
        reasoning, content = "thinking and the answer", None
    elif case.startswith("two_ends"):
        gen = k25.encode("thinking") + [end] + k25.encode("more") + [end] + k25.encode("the answer") + [eot]
        # a server that skips special tokens drops the second </think> from the content; one that
        # keeps them returns it, and the re-wrap is then the ids exactly
        content = "more</think>the answer" if case == "two_ends_in_text" else "morethe answer"
    else:
        gen = k25.encode("thinking") + [start] + k25.encode("again") + [end] + k25.encode("the answer") + [eot]
        reasoning = "thinking<think>again"
    sample = {"id": "s", "messages": [{"role": "user", "content": "q"}], "prompt_token_ids": prompt,
              "token_ids": gen, "reasoning": reasoning, "content": content}
    t = tokenize_sample(sample, k25)
    expected = {"never_closed": "end of turn with the reasoning never closed", "two_ends": "2 reasoning ends",
                "two_ends_in_text": "2 reasoning ends", "reopened": "reasoning opened again"}[case]
    assert t.malformed == expected and t.input_ids[t.prompt_len:] == gen  # counted; the ids kept as returned
    if case in ("never_closed", "two_ends"):  # the re-wrap adds a </think> / drops one: it differs, and says why
        assert t.mismatch is not None and t.mismatch["kind"] == MALFORMED
    else:  # the texts hold the extra <think> / </think>: the re-wrap equals the ids, nothing to explain
        assert t.mismatch is None


def test_well_formed_answers_are_not_malformed(k25, thinking_first):
    for fmt in (k25, thinking_first):
        prompt, gen = emitted(fmt, "thinking", "answer")
        assert malformed_reason(fmt, prompt, gen, "stop") is None
        # cut by max_tokens inside the reasoning: unfinished, not malformed
        assert malformed_reason(fmt, prompt, gen[: len(gen) // 2], "length") is None
