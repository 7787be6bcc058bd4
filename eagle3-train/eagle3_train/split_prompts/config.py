"""01_split_prompts' settings."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from eagle3_train.common.config import SPLIT_PROMPTS, StageConfig, require, setting

TRAIN_FILE = "train.jsonl"
HELDOUT_FILE = "heldout.jsonl"


@dataclass(kw_only=True)
class SplitConfig(StageConfig):
    """Everything but --overwrite decides which prompts land on which side, so a rerun must match
    it (a held-out set that moved would put trained prompts into the evaluation)."""

    stage: ClassVar[str] = SPLIT_PROMPTS
    outputs: ClassVar[tuple[str, ...] | None] = (TRAIN_FILE, HELDOUT_FILE)
    claims: ClassVar[tuple[str, ...]] = (TRAIN_FILE, HELDOUT_FILE)

    # -- the prompt source, read as 01b's --input
    input: str = setting(help="prompts: a .jsonl/.json file, a saved dataset dir, or a hub dataset name "
                              "(as 01b's --input)")
    split: str = setting("train", help="dataset split")
    dataset_config: str | None = setting(None, help="dataset config name (default: none)")
    id_field: str | None = setting(None, help=(
        "field holding the prompt id (default: id/prompt_id/conversation_id/uuid/idx, else a hash of "
        "the conversation)"))
    limit: int | None = setting(None, help="split the first N prompts (default: all)")

    # -- the split
    heldout: float = setting(help="held-out prompts: a count (200) or a fraction of the prompts below 1 (0.01)")
    seed: int = setting(0, help="seed of the held-out choice (a hash of seed and id)")

    output_dir: Path = setting(resume=True, help="where train.jsonl, heldout.jsonl and manifest.json go")
    overwrite: bool = setting(False, resume=True, help=(
        "start over: move a split of other settings aside into replaced-<time>/ (default: refuse it; "
        "the same settings again leave the split as it is)"))

    def validate(self):
        if Path(self.input).exists():  # a rerun from another directory is the same split
            self.input = str(Path(self.input).resolve())
            source = Path(self.input)
            # the split is written over the file it reads: the held-out prompts would leave the input for good
            ours = source.name in (TRAIN_FILE, HELDOUT_FILE) and source.parent == Path(self.output_dir).resolve()
            require(not ours,
                    f"--input {source} is one of the files 01 writes into --output-dir {self.output_dir}: "
                    "pass another --output-dir")
        require(self.limit is None or self.limit >= 1, f"--limit must be >= 1, not {self.limit}")
        require(self.heldout > 0 and math.isfinite(self.heldout),
                f"--heldout must be positive (a count, or a fraction below 1), not {self.heldout:g}")
        require(self.heldout < 1 or self.heldout == int(self.heldout),
                f"--heldout {self.heldout:g}: a count must be a whole number (a fraction is below 1)")
        if self.heldout >= 1:
            self.heldout = int(self.heldout)  # recorded as the count given: 200, not 200.0
