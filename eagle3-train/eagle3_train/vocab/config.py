"""03_build_vocab_mapping's settings."""

from __future__ import annotations

import sys
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

    def draft_size(self, vocab_size: int) -> int:
        """K for a target of `vocab_size` ids, checking what the flags name against that vocabulary.
        A K past it is clamped with one warning rather than refused: the default (32000) is sized for
        large targets, and on a small one the whole vocabulary is the only draft vocabulary it asks for."""
        for name in ("think_start_id", "think_end_id", "end_of_turn_id"):
            value = getattr(self, name)
            require(value is None or value < vocab_size,
                    f"--{name.replace('_', '-')} {value} is not a token of the target (0..{vocab_size - 1}): "
                    "pass its id in this vocabulary")
        big = [s for s in self.coverage_sizes or () if s > vocab_size]
        require(not big, f"--coverage-sizes {', '.join(map(str, big))} exceed the target's vocabulary of "
                         f"{vocab_size}: pass sizes up to {vocab_size}")
        if self.draft_vocab_size <= vocab_size:
            return self.draft_vocab_size
        print(f"warning: --draft-vocab-size {self.draft_vocab_size} exceeds the target vocabulary; using {vocab_size} "
              f"(all of it; pass --draft-vocab-size {vocab_size} or less to choose)", file=sys.stderr)
        return vocab_size

    def validate(self):
        require(0 <= self.heldout_fraction < 1, f"--heldout-fraction must be in [0, 1), not {self.heldout_fraction}")
        require(self.draft_vocab_size >= 1, f"--draft-vocab-size must be positive, not {self.draft_vocab_size}")
        require(self.progress_every >= 0, f"--progress-every must not be negative, not {self.progress_every}")
        for name in ("think_start_id", "think_end_id", "end_of_turn_id"):
            value = getattr(self, name)
            require(value is None or value >= 0,
                    f"--{name.replace('_', '-')} must be a token id (0 or more), not {value}")
        require(not self.coverage_sizes or min(self.coverage_sizes) >= 1,
                f"--coverage-sizes must be positive, not {self.coverage_sizes}")
        require(self.freq_from is None or not self.recount,
                "--freq-from reuses another output's counts and --recount counts again: give one")
        self.data, self.target, self.tokenizer = _local(self.data), _local(self.target), _local(self.tokenizer)
        self.tokenizer = self.tokenizer or self.target
