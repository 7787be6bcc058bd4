"""04 --follow on a store whose producer plans nothing ahead (01b --capture-hidden-states): header.json
from its start, plan.json only at its end. The open-ended mode:

- which mode: `mode()` decides it once, at the run's first start, and run.json records it (a rerun
  keeps it, though plan.json appears when 01b finishes); the run's identity is the header alone;
- the split is made per sample as each shard arrives (split.is_heldout by id, the rule 04 uses on
  a finished store), --val-max-samples applying to the first held-out ids in arrival order; each
  shard's batches are packed from its index entry (ids, lengths) as in the planned mode;
- the length: the step count is unknown until the producer's manifest exists. The lr warms up, then
  stays at its peak until the checkpoint at step --save-every (not the ones 04 makes while it waits
  for a shard: their steps depend on timing), which fixes the horizon
  H = steps x expected training samples / training samples trained so far (the header's
  `expected_samples`, scaled by the training share of the samples reached). That step and what
  H is computed from depend on the arrival order only, never on timing, so an uninterrupted run
  and a resumed one agree. The configured schedule then runs over H, at its floor past H;
- the end: the producer's manifest exists, every committed shard is taken and fewer than one
  step's batches are left (Follow.ensure).
"""

from __future__ import annotations

import math
import random
from pathlib import Path

from eagle3_train.common import hidden_store as hs
from eagle3_train.common.errors import PipelineError
from eagle3_train.train.data import pack, train_units

OPEN = "open"  # the mode's name in run.json (inputs.hidden_states.follow_mode)
EXPECTED = "expected_samples"  # header.json: the samples 01b will ask for, known at its start
UNBOUNDED = 1 << 60  # the open pass's batch count until its end is known


def recorded_mode(config) -> str | None:
    """The follow mode run.json recorded at this run's first start (None: a new run)."""
    from eagle3_train.common import rerun

    if getattr(config, "overwrite", False):
        return None
    rec = rerun.read_record(Path(config.output_dir)) or {}
    store = (rec.get("inputs") or {}).get("hidden_states") or {}
    return store.get("follow_mode", "planned") if "follow_identity" in store else None


def mode(config, directory: Path, header: dict) -> str:
    """What run.json recorded, else "planned" (plan.json) or OPEN (header.json with expected_samples,
    no plan.json); a header without expected_samples and no plan is refused."""
    recorded = recorded_mode(config)
    if recorded is not None:
        return recorded
    if (directory / hs.PLAN).exists():
        return "planned"
    if EXPECTED in header:
        return OPEN
    raise PipelineError(f"{directory} has {hs.HEADER} but no {hs.PLAN}, and its header says nothing of the samples "
                        f"to come ({EXPECTED}): it was made by an older 01b --capture-hidden-states; rerun 01b "
                        "(it resumes and rewrites the header), or train once it has finished")


class OpenSchedule:
    """The lr factor at a step of an open-ended follow: warm-up, then peak until `horizon` is fixed,
    then `rule` (draft.lr_lambda) over it. A plain object: LambdaLR's state_dict keeps its
    attributes, so a resume gets the horizon back with the scheduler."""

    def __init__(self, rule, warmup: int):
        self.rule, self.warmup, self.horizon, self.fixed_at = rule, warmup, None, None

    def fix(self, horizon: int, step: int) -> None:
        self.horizon, self.fixed_at = horizon, step

    def __call__(self, step: int) -> float:
        # up to the fixing step the lr was computed without H (LambdaLR computes step s's lr after step s - 1)
        if self.horizon is None or step <= self.fixed_at:
            return (step + 1) / self.warmup if self.warmup and step < self.warmup else 1.0
        return self.rule(step, warmup=self.warmup, total=self.horizon)


def default_warmup(config, expected: int, per_step: int) -> int:
    """--warmup-steps, or --warmup-ratio of the steps the expected training samples make at one
    sample a batch (the most they can make: the real count is unknown before the first shard)."""
    if config.warmup_steps is not None:
        return config.warmup_steps
    return int(config.warmup_ratio * expected * (1 - config.val_fraction) / per_step)


def horizon(follow, step: int, expected: int) -> dict:
    """H at `step` from what the first `step` steps trained (a function of the arrival order)."""
    done = step * follow.plan.per_step
    with follow.lock:
        trained = {unit_id(u) for b in follow.stream[:done] for u in b}
        reached = [k for k in follow.arrivals if follow.start[k] < done]
        ids = [sid for k in reached for sid in follow.shards[k]["ids"]]
    share = sum(sid in follow.train_ids for sid in ids) / max(1, len(ids))
    expected_train = expected * share
    h = max(step, math.ceil(step * expected_train / max(1, len(trained))))
    return {"horizon": h, "at_step": step, "expected_samples": expected, "trained_samples": len(trained),
            "train_share": round(share, 6)}


def split_shard(follow, entry: dict) -> list:
    """Open-ended (`follow`: a Follow): shard `entry`'s samples split as they arrive (the first --val-max-samples
    held-out ids in arrival order validate), its training batches packed as planned shards' are."""
    from eagle3_train.common.split import is_heldout

    cfg, k, plan = follow.config, entry["k"], follow.plan
    lengths = dict(zip(entry["ids"], entry["lengths"], strict=True))
    train, val, dropped = [], [], 0
    for sid in entry["ids"]:
        if lengths[sid] < 3:
            dropped += 1
        elif is_heldout(sid, cfg.val_fraction) and (cfg.val_max_samples is None
                                                   or len(plan.val) + len(val) < cfg.val_max_samples):
            val.append(sid)
        else:
            train.append(sid)
    units, sizes, cut = train_units(train, lengths, cfg)
    with follow.lock:
        follow.shards[k] = {"k": k, "ids": entry["ids"], "lengths": entry["lengths"]}
        plan.train += train
        plan.val += val
        plan.dropped += dropped
        plan.lengths |= lengths
        follow.train_ids |= set(train)
        follow.val_ids |= set(val)
        follow.units += units
        follow.sizes |= sizes
    follow.batches[k] = pack(units, sizes, cfg.max_tokens_per_batch, random.Random(f"{cfg.seed}:shard-{k}"),
                             max_sample=cut)
    return follow.batches[k]


def unit_id(u) -> str:
    return u if isinstance(u, str) else u[0]
