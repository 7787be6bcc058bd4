"""The held-out split, one rule for every stage: a sample is held out by its id alone.

03 measures coverage on it, 04 validates on it, 05 evaluates on it; the same id is held out in
every run, whatever the file order or the shard it landed in.
"""

from __future__ import annotations

import hashlib

SPLIT = "blake2b-64(id) / 2**64 < heldout_fraction"  # recorded in manifests next to the fraction


def is_heldout(sample_id, fraction: float) -> bool:
    """Fixed split by id: the same sample is held out in every run, whatever the file order."""
    if fraction <= 0:
        return False
    h = int.from_bytes(hashlib.blake2b(str(sample_id).encode(), digest_size=8).digest(), "big")
    return h / 2.0**64 < fraction
