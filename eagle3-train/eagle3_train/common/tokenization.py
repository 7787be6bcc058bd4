"""The one place that turns a generated sample into the training sequence.

Every stage that needs `input_ids` / `loss_mask` calls `tokenize_sample` (through
`ChatFormat`); nothing else in the project concatenates prompt and answer tokens. That is the
point: the seeds' bug was two copies of this logic that disagreed.

A sample is the prompt `messages` plus the model's answer as
  (a) the exact ids the server returned (`prompt_token_ids` + `token_ids`), and/or
  (b) the `reasoning` and `content` texts.
(a) is the truth when present; (b) is rebuilt by wrapping the reasoning in the think tokens
exactly as the target emits them, and when both exist (b) is checked against (a) and any
difference is reported, never silently accepted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from eagle3_train.common.errors import PipelineError
from eagle3_train.common.mismatch import classify_mismatch, compare_ids, malformed_reason

THINK_START = "<think>"
THINK_END = "</think>"
# End-of-turn tokens of the chat families we know, tried in order; else the tokenizer's EOS.
END_OF_TURN_CANDIDATES = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")


def token_id(tokenizer, token: str) -> int | None:
    """The id of `token` as a single vocabulary entry, or None if the tokenizer lacks it."""
    tid = tokenizer.convert_tokens_to_ids(token)
    if tid is None or not isinstance(tid, int):
        return None
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is not None and tid == unk and token != getattr(tokenizer, "unk_token", None):
        return None
    if tokenizer.convert_ids_to_tokens(tid) != token:
        return None
    return tid


@dataclass(frozen=True)
class ChatFormat:
    """How the target writes a turn: its tokenizer, template, think and end-of-turn tokens."""

    tokenizer: Any = field(repr=False, compare=False)
    reasoning: bool
    think_start_id: int | None
    think_end_id: int | None
    end_of_turn_id: int
    chat_template_kwargs: dict = field(default_factory=dict)

    @classmethod
    def from_tokenizer(cls, tokenizer, *, reasoning: bool = True, think_start_id: int | None = None,
                       think_end_id: int | None = None, end_of_turn_id: int | None = None,
                       chat_template_kwargs: dict | None = None) -> ChatFormat:
        vocab = len(tokenizer)
        for name, val in (("think-start-id", think_start_id), ("think-end-id", think_end_id),
                          ("end-of-turn-id", end_of_turn_id)):
            if val is not None and not 0 <= val < vocab:
                raise PipelineError(f"--{name} {val} is outside the tokenizer's vocabulary (0..{vocab - 1})")
        if reasoning:
            think_start_id = think_start_id if think_start_id is not None else token_id(tokenizer, THINK_START)
            think_end_id = think_end_id if think_end_id is not None else token_id(tokenizer, THINK_END)
            missing = [t for t, i in ((THINK_START, think_start_id), (THINK_END, think_end_id)) if i is None]
            if missing:
                raise PipelineError(
                    f"the tokenizer has no {' / '.join(missing)} token: pass --think-start-id and "
                    "--think-end-id, or --no-reasoning if the model does not reason")
        else:
            think_start_id = think_end_id = None
        if end_of_turn_id is None:
            for cand in END_OF_TURN_CANDIDATES:
                if (end_of_turn_id := token_id(tokenizer, cand)) is not None:
                    break
            else:
                end_of_turn_id = tokenizer.eos_token_id
            if end_of_turn_id is None:
                raise PipelineError("the tokenizer has no end-of-turn or EOS token: pass --end-of-turn-id")
        if not getattr(tokenizer, "chat_template", None):
            raise PipelineError("the tokenizer has no chat template")
        return cls(tokenizer, reasoning, think_start_id, think_end_id, end_of_turn_id,
                   dict(chat_template_kwargs or {}))

    # -- rendering ----------------------------------------------------------------------------

    def render(self, messages: list[dict], *, add_generation_prompt: bool) -> list[int]:
        try:
            ids = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                return_dict=False, **self.chat_template_kwargs)
        except Exception as e:  # jinja errors name the template problem; keep it on one line
            raise PipelineError(f"chat template failed on these messages: {type(e).__name__}: "
                                f"{str(e).splitlines()[0] if str(e) else ''}") from None
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    def encode(self, text: str | None) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False)) if text else []

    def opens_thinking(self, prompt_ids: Sequence[int]) -> str:
        """What the generation prompt leaves for the model to write, read off the rendered ids:
        'inside' (the prompt opens <think> and leaves it open, K2.5), 'closed' (it opens and closes
        it: thinking switched off, K2.5's `<think></think>` or Qwen3's `<think>\n\n</think>\n\n`),
        'before' (the model writes <think> itself, K2-Thinking/Qwen3), 'none'."""
        if not self.reasoning:
            return "none"
        # Only the generation prompt counts: earlier turns before the last end-of-turn carry think
        # tokens of their own (K2.5 renders them as an empty <think></think>).
        tail = list(prompt_ids)
        if self.end_of_turn_id in tail:
            tail = tail[len(tail) - tail[::-1].index(self.end_of_turn_id):]
        if self.think_start_id not in tail:
            return "before"
        opened = len(tail) - tail[::-1].index(self.think_start_id)
        return "closed" if self.think_end_id in tail[opened:] else "inside"

    def generated_ids(self, prompt_ids: Sequence[int], reasoning: str | None, content: str | None,
                      finish_reason: str | None = "stop") -> list[int]:
        """Path (b): the assistant's tokens rebuilt from texts, as the target would emit them."""
        truncated = finish_reason == "length"
        mode = self.opens_thinking(prompt_ids)
        out: list[int] = []
        if mode in ("inside", "before"):
            if mode == "before":
                out.append(self.think_start_id)
            out += self.encode(reasoning)
            # A generation cut by max_tokens inside the reasoning has no </think> and no content.
            if not (truncated and content is None):
                out.append(self.think_end_id)
        out += self.encode(content)
        if not truncated:
            out.append(self.end_of_turn_id)
        return out

    def rewrap(self, messages: list[dict], reasoning: str | None, content: str | None,
               finish_reason: str | None = "stop") -> tuple[list[int], list[int]]:
        """Path (b) whole: the rendered generation prompt and the answer rebuilt from its texts
        (think-start if the target writes it, reasoning, think-end, content, end-of-turn)."""
        prompt = self.render(messages, add_generation_prompt=True)
        return prompt, self.generated_ids(prompt, reasoning, content, finish_reason)

    def describe(self) -> dict:
        d = asdict(self)
        d.pop("tokenizer", None)
        return d


@dataclass
class Tokenized:
    input_ids: list[int]
    loss_mask: list[int]
    prompt_len: int
    num_truncated: int
    source: str  # "token_ids" (path a) or "text" (path b, or ids that were made from text)
    mismatch: dict | None = None  # when both paths exist and differ: count, first, lengths, kind
    malformed: str | None = None  # why the returned answer is not well formed (mismatch.malformed_reason)

    @property
    def num_supervised(self) -> int:
        return sum(self.loss_mask)


def _check_vocab(ids: Sequence[int], vocab: int, what: str, sample_id) -> None:
    bad = next((t for t in ids if not isinstance(t, int) or not 0 <= t < vocab), None)
    if bad is not None:
        raise PipelineError(f"sample {sample_id}: {what} has token id {bad!r} outside the tokenizer's "
                            f"vocabulary of {vocab} (made with another tokenizer?)")


def assistant_spans(fmt: ChatFormat, messages: list[dict], prompt_ids: Sequence[int]) -> list[tuple[int, int]]:
    """[start, end) of each earlier assistant turn's generated tokens inside `prompt_ids`.

    Turn k starts where the rendering of messages[:k] with a generation prompt ends (checked to be
    a prefix of the full rendering) and ends at the next end-of-turn token, inclusive."""
    spans = []
    for k, msg in enumerate(messages):
        if msg.get("role") != "assistant":
            continue
        head = fmt.render(messages[:k], add_generation_prompt=True)
        if list(prompt_ids[: len(head)]) != head:
            raise PipelineError("the chat template is not prefix-stable for earlier assistant turns; "
                                "use --loss-on final")
        try:
            end = list(prompt_ids).index(fmt.end_of_turn_id, len(head)) + 1
        except ValueError:
            raise PipelineError(f"assistant turn {k} has no end-of-turn token in the rendered prompt") from None
        spans.append((len(head), end))
    return spans


def _plain_text(content) -> str:
    """A message's text: a string, or the text parts of an OpenAI content list."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text") or "" for p in content if isinstance(p, dict))
    return ""


def tokenize_sample(sample: dict, fmt: ChatFormat, *, max_seq_len: int | None = None,
                    loss_on: str = "final") -> Tokenized:
    """One sample -> the training sequence (see module doc). Raises PipelineError on bad input."""
    sid = sample.get("id", "?")
    messages = sample.get("messages")
    if not isinstance(messages, list) or not messages:
        raise PipelineError(f"sample {sid}: no prompt messages")
    users = [m for m in messages if isinstance(m, dict) and m.get("role") == "user"]
    if not users or not _plain_text(users[-1].get("content")).strip():
        raise PipelineError(f"sample {sid}: empty prompt (the last user turn has no text)")
    if loss_on not in ("final", "all"):
        raise PipelineError(f"--loss-on must be 'final' or 'all', not {loss_on!r}")
    vocab = len(fmt.tokenizer)
    has_ids = sample.get("token_ids") is not None and sample.get("prompt_token_ids") is not None
    has_text = sample.get("reasoning") is not None or sample.get("content") is not None
    finish = sample.get("finish_reason") or "stop"

    text_ids = None
    if has_text or not has_ids:
        text_ids = fmt.rewrap(messages, sample.get("reasoning"), sample.get("content"), finish)
    if has_ids:
        prompt, gen = list(sample["prompt_token_ids"]), list(sample["token_ids"])
        _check_vocab(prompt, vocab, "prompt_token_ids", sid)
        _check_vocab(gen, vocab, "token_ids", sid)
        # Ids made by re-wrapping text (01a, or 01b's text fallback) stay marked as text-derived.
        source = "text" if sample.get("source") == "text" else "token_ids"
    else:
        prompt, gen = text_ids
        source = "text"
    if not prompt:
        raise PipelineError(f"sample {sid}: empty prompt")

    input_ids = prompt + gen
    loss_mask = [0] * len(prompt) + [1] * len(gen)
    if loss_on == "all":
        for start, end in assistant_spans(fmt, messages, prompt):
            loss_mask[start:end] = [1] * (end - start)

    mismatch = None
    malformed = malformed_reason(fmt, prompt, gen, finish) if has_ids else None
    if has_ids and has_text:
        mismatch = compare_ids(input_ids, text_ids[0] + text_ids[1])
        if mismatch is not None:
            mismatch["kind"] = classify_mismatch(fmt, prompt, gen, text_ids[0], sample.get("reasoning"),
                                                 sample.get("content"), finish)

    truncated = 0
    if max_seq_len is not None and len(input_ids) > max_seq_len:
        truncated = len(input_ids) - max_seq_len
        input_ids, loss_mask = input_ids[:max_seq_len], loss_mask[:max_seq_len]
    return Tokenized(input_ids, loss_mask, len(prompt), truncated, source, mismatch, malformed)


# ----------------------------------------------------------------------------- command line

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "tiktoken.model", "vocab.json")


def load_tokenizer(name_or_path: str):
    """A local directory or a hub id; a path that is no tokenizer directory is refused by name (transformers
    would read it as a malformed hub id)."""
    from pathlib import Path

    from transformers import AutoTokenizer

    path = Path(name_or_path).expanduser()
    if path.is_absolute() or name_or_path.startswith((".", "~")) or path.exists():
        if not path.is_dir():
            raise PipelineError(f"tokenizer {name_or_path!r}: no such directory (give the model's directory or a hub id)")
        if not any((path / f).is_file() for f in TOKENIZER_FILES):
            raise PipelineError(f"tokenizer {name_or_path!r}: the directory holds none of {', '.join(TOKENIZER_FILES)}")
    try:
        return AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=True)
    except (OSError, ValueError) as e:
        raise PipelineError(f"cannot load tokenizer {name_or_path!r}: {str(e).splitlines()[0]}") from None


def chat_format_from_args(args, default_tokenizer: str | None = None) -> ChatFormat:
    """The ChatFormat of a config holding configs.tokenize.TokenizeSettings."""
    name = args.tokenizer or default_tokenizer
    if not name:
        raise PipelineError("no tokenizer: pass --tokenizer (or --model)")
    return ChatFormat.from_tokenizer(
        load_tokenizer(name), reasoning=not args.no_reasoning, think_start_id=args.think_start_id,
        think_end_id=args.think_end_id, end_of_turn_id=args.end_of_turn_id,
        chat_template_kwargs=args.chat_template_kwargs)
