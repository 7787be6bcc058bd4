"""01c_tokenize's settings, and the tokenization settings 01b shares (`01b --tokenize`)."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from eagle3_train.common.config import TOKENIZE, Settings, StageConfig, require, setting

LOSS_ON = ("final", "all")
# --max-seq-len when neither it, 01b's --max-tokens nor the server's max_model_len is known
FALLBACK_SEQ_LEN = 8192


@dataclass(kw_only=True)
class TokenizeSettings(Settings):
    """How answers become training records. In 01b these shape only `tokenized/`, which is
    rebuilt whenever they change, so they may change on a resume (chat_template_kwargs, which is
    also sent to the server, may not)."""

    tokenizer: str | None = setting(None, resume=True, help="tokenizer path or name (default: the target model's)")
    think_start_id: int | None = setting(None, resume=True,
                                         help="override the <think> token id (default: looked up by string)")
    think_end_id: int | None = setting(None, resume=True,
                                       help="override the </think> token id (default: looked up by string)")
    end_of_turn_id: int | None = setting(None, resume=True, help=(
        "override the end-of-turn id (default: <|im_end|>/<|eot_id|>/..., else EOS)"))
    no_reasoning: bool = setting(False, resume=True,
                                 help="the target does not reason: no think tokens expected (default: it does)")
    chat_template_kwargs: dict = setting(default_factory=dict, help=(
        'JSON passed to the chat template, e.g. \'{"thinking": false}\' (default: {})'))
    max_seq_len: int | None = setting(None, resume=True, help=(
        "truncate training sequences to this many tokens (default: the longest prompt + 01b's --max-tokens, the "
        f"longest sample 01b can return; without --max-tokens the server's max_model_len 01b recorded, else "
        f"{FALLBACK_SEQ_LEN}; a set built before this default resumes with the value it was built with)"))
    loss_on: str = setting("final", resume=True,
                           help="supervise the final assistant turn or every assistant turn")
    keep_length: bool = setting(True, resume=True,
                                help="keep answers cut by max_tokens (finish_reason=length) (default)")

    def validate_tokenization(self) -> None:
        require(isinstance(self.chat_template_kwargs, dict), "--chat-template-kwargs must be a JSON object")
        require(self.loss_on in LOSS_ON, f"--loss-on {self.loss_on!r}: choose final or all")
        require(self.max_seq_len is None or self.max_seq_len > 0,
                f"--max-seq-len must be positive, not {self.max_seq_len}")
        for name in ("think_start_id", "think_end_id", "end_of_turn_id"):  # the vocabulary's bound: ChatFormat
            value = getattr(self, name)
            require(value is None or value >= 0,
                    f"--{name.replace('_', '-')} must be a token id (0 or more), not {value}")
        require(not self.no_reasoning or (self.think_start_id is None and self.think_end_id is None),
                "--think-start-id/--think-end-id name the think tokens, which --no-reasoning says the target has "
                "none of: drop one or the other")


def add_tokenization_args(parser: argparse.ArgumentParser, C=TokenizeSettings) -> None:
    """The shared flags (01b and 01c), with the config's defaults and help."""
    g = parser.add_argument_group("tokenization (shared by every stage)")
    g.add_argument("--tokenizer", **C.arg("tokenizer"))
    g.add_argument("--think-start-id", type=int, **C.arg("think_start_id"))
    g.add_argument("--think-end-id", type=int, **C.arg("think_end_id"))
    g.add_argument("--end-of-turn-id", type=int, **C.arg("end_of_turn_id"))
    g.add_argument("--no-reasoning", action="store_true", **C.arg("no_reasoning"))
    g.add_argument("--chat-template-kwargs", type=json.loads, **C.arg("chat_template_kwargs"))
    g.add_argument("--max-seq-len", type=int, **C.arg("max_seq_len"))
    g.add_argument("--loss-on", choices=LOSS_ON, **C.arg("loss_on"))
    k = g.add_mutually_exclusive_group()
    k.add_argument("--keep-length", action="store_true", **C.arg("keep_length"))
    k.add_argument("--drop-length", action="store_false", dest="keep_length",
                   help="drop answers cut by max_tokens")


@dataclass(kw_only=True)
class TokenizeConfig(TokenizeSettings, StageConfig):
    stage: ClassVar[str] = TOKENIZE

    raw_dir: Path = setting(help="output directory of 01b (with raw_responses.jsonl)")
    output_dir: Path | None = setting(None, help="where data.jsonl goes (default: <raw-dir>/tokenized)")
    progress_every: float = setting(30.0, help="seconds between lines in progress.log")

    def validate(self):
        self.raw_dir = Path(self.raw_dir)
        self.output_dir = Path(self.output_dir) if self.output_dir else self.raw_dir / "tokenized"
        self.validate_tokenization()



def resolve_max_seq_len(given: int | None, *, longest_prompt: int | None, max_tokens: int | None,
                        max_model_len: int | None, recorded: int | None = None) -> tuple[int, str, str | None]:
    """--max-seq-len as the tokenization applies it: (tokens, where the number came from, a note to
    print or None). Unset, it is the longest sample 01b can return (the longest prompt + its
    --max-tokens), so no answer is cut; without --max-tokens the server's context (max_model_len,
    which holds prompt + answer); else FALLBACK_SEQ_LEN, noted. `recorded`: the value a set was
    built with before this default existed (no source in its manifest): a bare rerun keeps it."""
    if given is not None:
        return given, "given", None
    if recorded is not None:
        return recorded, "recorded", (f"tokenize: --max-seq-len {recorded:,}, as this set was built (pass "
                                      "--max-seq-len to change it)")
    if max_tokens and longest_prompt is not None:
        return longest_prompt + max_tokens, "longest prompt + --max-tokens", None
    if max_model_len:
        return max_model_len, "server max_model_len", None
    return FALLBACK_SEQ_LEN, "fallback", (f"note: --max-seq-len {FALLBACK_SEQ_LEN}: 01b recorded no --max-tokens and "
                                          "no server max_model_len; pass --max-seq-len to choose")


def shortfall_warning(max_seq_len: int, *, longest_prompt: int | None, max_tokens: int | None, cut: int,
                      dropped: int, answers: int) -> str | None:
    """One line when a given --max-seq-len is below what 01b can return (the longest prompt + its
    --max-tokens): how many answers it cut, and how many of those lost every supervised token."""
    if not max_tokens or longest_prompt is None or max_seq_len >= longest_prompt + max_tokens:
        return None
    return (f"warning: --max-seq-len {max_seq_len:,} is below the longest prompt ({longest_prompt:,}) + 01b's "
            f"--max-tokens ({max_tokens:,}) = {longest_prompt + max_tokens:,}: {cut} of {answers} answers cut to "
            f"fit, {dropped} of them dropped (nothing supervised left); leave --max-seq-len out to keep them whole")
