"""03_build_vocab_mapping's settings."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from eagle3_train.common.config import VOCAB, StageConfig, require, setting
from eagle3_train.vocab.mapping import COVERAGE_JSON, COVERAGE_PNG, MAPPING


def _local(name: str | Path | None):
    """A path that exists, made absolute (so a rerun from elsewhere is the same run); a hub name as is."""
    return str(Path(name).resolve()) if name is not None and Path(name).exists() else name


@dataclass(kw_only=True)
class VocabConfig(StageConfig):
    stage: ClassVar[str] = VOCAB
    # the mapping and the report move aside on --overwrite; the token counts stay, reusable
    outputs: ClassVar[tuple[str, ...] | None] = (MAPPING, COVERAGE_JSON, COVERAGE_PNG, "progress.log")

    # inputs: compared as given (made absolute), since 03 rebuilds whenever the input's bytes change
    data: str = setting(help="tokenized training set directory (data.jsonl + manifest)")
    target: str = setting(help="target model path or name; its config's vocab_size is the target vocabulary")
    tokenizer: str | None = setting(None, help=(
        "tokenizer path or name (default: the target's); must be the one the data was tokenized with"))

    output_dir: Path = setting(help="output directory", resume=True)
    overwrite: bool = setting(False, resume=True, help=(
        "start over: move a previous output (mapping, report, manifest) to replaced-<time>/; the token "
        "counts stay and are reused if they match (default: refuse other settings, resume the same)"))
    progress_every: float = setting(30.0, resume=True, help="seconds between lines in progress.log")

    # draft vocabulary
    draft_vocab_size: int = setting(32000, help="K, tokens in the draft vocabulary; clamped to the target vocab")
    keep_tokens: list[str] = setting(default_factory=list, help=(
        "extra token strings always kept, e.g. tool-call markers (default: none; think-start/-end, "
        "end-of-turn and EOS are always kept)"))
    no_reasoning: bool = setting(False, help=(
        "the target does not reason: no think tokens to keep (default: as the data's manifest recorded, "
        "else it reasons)"))
    think_start_id: int | None = setting(None, help="override the <think> id (default: recorded by tokenize, "
                                                    "else looked up by string)")
    think_end_id: int | None = setting(None, help="override the </think> id (default: recorded by tokenize, "
                                                  "else looked up by string)")
    end_of_turn_id: int | None = setting(None, help="override the end-of-turn id (default: recorded by "
                                                    "tokenize, else looked up by string)")

    # coverage report
    heldout_fraction: float = setting(0.1, help=(
        "share of samples (fixed by id hash) held out to measure coverage of a vocabulary chosen "
        "without them (default: 0.1; 0 = none)"))
    coverage_sizes: list[int] | None = setting(None, help=(
        "sizes on the coverage curve (default: a log grid over the target vocab, 4096..65536 and K)"))

    # token counts
    freq_from: Path | None = setting(None, resume=True, help=(
        "reuse the counts of another 03 output for this same input, to build another size without "
        "recounting; refused if they were counted from anything else"))
    recount: bool = setting(False, resume=True, help="count again even if matching counts exist (default: reuse them)")

    def validate(self):
        require(0 <= self.heldout_fraction < 1, f"--heldout-fraction must be in [0, 1), not {self.heldout_fraction}")
        require(self.draft_vocab_size >= 1, f"--draft-vocab-size must be positive, not {self.draft_vocab_size}")
        require(self.progress_every >= 0, f"--progress-every must not be negative, not {self.progress_every}")
        self.data, self.target, self.tokenizer = _local(self.data), _local(self.target), _local(self.tokenizer)
        self.tokenizer = self.tokenizer or self.target
