"""01a_import_text's settings."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from eagle3_train.common.config import IMPORT_TEXT, StageConfig, require, setting
from eagle3_train.common.layout import RAW, RAW_DIR_OUTPUTS
from eagle3_train.tokenize.config import TokenizeSettings

# In 01b these only shape tokenized/ (resumable there); here they make the ids of raw_responses.jsonl.
REWRAP_SETTINGS = frozenset({"tokenizer", "think_start_id", "think_end_id", "end_of_turn_id", "no_reasoning"})


@dataclass(kw_only=True)
class ImportTextConfig(TokenizeSettings, StageConfig):
    """The import is rebuilt whole on every run; what it was built from (the input, the ids' source
    field, the tokenizer and the think/end-of-turn ids) makes it one data set, so a rerun with
    other values is refused unless --overwrite, as for 01b."""

    stage: ClassVar[str] = IMPORT_TEXT
    # --overwrite moves aside whatever a 01b run or an earlier import left here
    outputs: ClassVar[tuple[str, ...] | None] = RAW_DIR_OUTPUTS
    claims: ClassVar[tuple[str, ...]] = (RAW,)

    input: str = setting(help="JSONL of answers with reasoning/content and their prompts")
    id_field: str | None = setting(None, help=(
        "field holding the sample id (default: id/prompt_id/conversation_id/uuid/idx, else a hash of "
        "the conversation)"))
    model: str | None = setting(None, help=(
        "the target that wrote the answers, recorded; also the default --tokenizer (default: none)"))

    output_dir: Path = setting(resume=True, help="where raw_responses.jsonl and its manifest go")
    overwrite: bool = setting(False, resume=True, help=(
        "start over: move a previous output (a 01b run, or an import of other settings) aside into "
        "replaced-<time>/ (default: refuse those; an import of the same settings is simply rebuilt)"))
    progress_every: float = setting(30.0, resume=True, help="seconds between lines in progress.log")
    tokenize: bool = setting(False, resume=True, help=(
        "also write <output-dir>/tokenized/ as 01c_tokenize.py does"))

    @classmethod
    def resumable(cls) -> frozenset[str]:
        return super().resumable() - REWRAP_SETTINGS

    def validate(self):
        self.input = str(Path(self.input).resolve())  # a rerun from another directory is the same run
        require(Path(self.input).is_file(), f"--input {self.input}: no such file")
        self.tokenizer = self.tokenizer or self.model
        require(self.tokenizer is not None, "no tokenizer: pass --tokenizer (or --model)")
        require(self.progress_every >= 0, f"--progress-every must not be negative, not {self.progress_every}")
        self.validate_tokenization()
