"""02's and 04's --dry-run: 00's figures for that one stage, printed, nothing written.

The planner (plan/) models every stage and imports their pieces (04's epoch and lr rules,
02's layer parser), so it sits above the stages; a stage importing it would run upward and close a
circle between packages. The stages reach it here instead, by name: PLANNERS maps a stage id to the
planner function for its config, imported only when --dry-run is asked for (tests/test_layout.py
checks that every entry resolves, and that no stage imports plan/)."""

from __future__ import annotations

from importlib import import_module

from eagle3_train.common.config import EXTRACT, TRAIN

PLANNERS = {EXTRACT: "eagle3_train.plan.dry_runs:dry_run_extract",
            TRAIN: "eagle3_train.plan.dry_runs:dry_run_train"}


def planner(stage: str):
    """The planner function of a stage's --dry-run: f(cfg) -> exit code."""
    module, name = PLANNERS[stage].split(":")
    return getattr(import_module(module), name)


def dry_run(cfg) -> int:
    """Print the plan of cfg's stage (cfg: its StageConfig) and write nothing; the exit code."""
    return planner(cfg.stage)(cfg)
