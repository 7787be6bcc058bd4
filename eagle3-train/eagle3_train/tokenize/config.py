"""01c_tokenize's settings, and the tokenization settings 01b shares (`01b --tokenize`)."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from eagle3_train.common.config import TOKENIZE, Settings, StageConfig, require, setting

LOSS_ON = ("final", "all")


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
    max_seq_len: int = setting(8192, resume=True, help="truncate training sequences to this many tokens")
    loss_on: str = setting("final", resume=True,
                           help="supervise the final assistant turn or every assistant turn")
    keep_length: bool = setting(True, resume=True,
                                help="keep answers cut by max_tokens (finish_reason=length) (default)")

    def validate_tokenization(self) -> None:
        require(isinstance(self.chat_template_kwargs, dict), "--chat-template-kwargs must be a JSON object")
        require(self.loss_on in LOSS_ON, f"--loss-on {self.loss_on!r}: choose final or all")
        require(self.max_seq_len is None or self.max_seq_len > 0,
                f"--max-seq-len must be positive, not {self.max_seq_len}")


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
