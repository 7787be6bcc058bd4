"""The held-out split, one rule for every stage: a sample is held out by its id alone.

03 measures coverage on it, 04 validates on it, 05 evaluates on it; the same id is held out in
every run, whatever the file order or the shard it landed in. `pick_heldout` is the prompts'
split (01_split_prompts, the pilot, the demo): exactly N prompts by a seeded hash of their ids.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from eagle3_train.common.errors import PipelineError

SPLIT = "blake2b-64(id) / 2**64 < heldout_fraction"  # recorded in manifests next to the fraction


def is_heldout(sample_id, fraction: float) -> bool:
    """Fixed split by id: the same sample is held out in every run, whatever the file order."""
    if fraction <= 0:
        return False
    h = int.from_bytes(hashlib.blake2b(str(sample_id).encode(), digest_size=8).digest(), "big")
    return h / 2.0**64 < fraction


# ----------------------------------------------------------------------------- held-out prompts

PROMPT_SPLIT = "the N ids of smallest blake2b-64(f'{seed}:{id}') are held out (ties by id)"


def heldout_count(size: float, total: int, *, flag: str = "--heldout") -> int:
    """How many of `total` prompts to hold out: `size` >= 1 is a count, 0 < `size` < 1 a fraction
    of `total`, rounded half up (0.01 of 150 -> 2). Refuses a size that leaves no prompt on
    either side."""
    if not size > 0:
        raise PipelineError(f"{flag} must be positive (a count, or a fraction below 1), not {size:g}")
    if size >= 1 and size != int(size):
        raise PipelineError(f"{flag} {size:g}: a count must be a whole number (a fraction is below 1)")
    n = int(size) if size >= 1 else int(size * total + 0.5)
    if n < 1:
        raise PipelineError(f"{flag} {size:g} of {total} prompts holds out none: pass a count or a larger fraction")
    if n >= total:
        raise PipelineError(f"{flag} {size:g} holds out {n} of only {total} prompts, none left to train on: "
                            "pass a smaller --heldout (or more prompts)")
    return n


def _rank(seed: int, sample_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{seed}:{sample_id}".encode(), digest_size=8).digest(), "big")


def pick_heldout(ids: Sequence[str], count: int, seed: int = 0) -> set[str]:
    """The `count` held-out ids among `ids`: those of smallest blake2b(seed, id), so the choice
    depends on the ids and the seed alone (not their order), and the rest is disjoint from it."""
    seen: set[str] = set()
    for i in ids:
        if i in seen:
            raise PipelineError(f"id {i!r} appears twice among the prompts: one prompt per id")
        seen.add(i)
    if not 1 <= count < len(seen):
        raise PipelineError(f"cannot hold out {count} of {len(seen)} prompts: need 1 <= count < prompts")
    return set(sorted(seen, key=lambda i: (_rank(seed, i), i))[:count])
