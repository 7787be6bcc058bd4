"""04's run length and learning rate, chosen from the config, the data and the draft's width (pure:
04's config validates --budget with it before torch is imported).

- `parse_budget`: `--budget` as a time (`2h`, `30m`, `90s`), a token count (`5M`, `200k tokens`)
  or a step count (`3000`, `3000 steps`); anything else is one `error:` line.
- `choose_length`: epochs and optimizer steps. Given `--epochs`, those; given a budget, what it
  buys; else (the default) enough epochs that the run reaches `MIN_STEPS` steps, at most
  `MAX_EPOCHS` (issue 13: one epoch of a 2,000-prompt set is 73 steps and trained a useless draft).
- `choose_lr`: `--lr`, or by default `LR_REF * (LR_REF_WIDTH / width) ** LR_WIDTH_EXPONENT` for a
  draft `width` wide (the best lr falls as the draft widens: docs/measurements.md, "The default lr
  across widths").
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from eagle3_train.common.errors import PipelineError

MIN_STEPS = 1000  # optimizer steps a default run reaches (issue 13: ~1,000 steps matched speculators' best)
MAX_EPOCHS = 10  # ... repeating a small set at most this often
# The default lr: LR_REF for a draft LR_REF_WIDTH wide, times (LR_REF_WIDTH / width) ** LR_WIDTH_EXPONENT.
# Muon's update (match_rms_adamw) has an RMS of 0.2·lr per entry, so a wider layer's output moves more
# per step; the width ladder (scripts/bench/sweep_lr_width.py) measured how fast the best lr falls.
LR_REF, LR_REF_WIDTH, LR_WIDTH_EXPONENT = 3e-3, 256, 0.5

BUDGET_FORMS = "a time (2h, 30m, 90s), tokens (5M, 200k tokens) or steps (3000, 3000 steps)"
_TIME = {"h": 3600.0, "m": 60.0, "min": 60.0, "s": 1.0}
_SCALE = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "B": 1e9}


@dataclass(frozen=True)
class Budget:
    kind: str  # "time" (seconds), "tokens" or "steps"
    amount: float
    text: str


def parse_budget(text: str | None) -> Budget | None:
    """`--budget`: time units are lower case (h, m/min, s), token multipliers K/M/G (k too, with
    `tok`/`tokens`); a bare integer is steps."""
    if text is None:
        return None
    s = str(text).strip()
    bad = PipelineError(f"--budget must be {BUDGET_FORMS}, not {text!r}")
    # A zero or negative amount is a well-formed budget of nothing: say what is wrong with it.
    not_positive = PipelineError(f"--budget must be positive (a duration like 2h, tokens like 5M, or steps "
                                 f"like 3000), not {s}")
    if s.startswith("-") and s[1:].strip()[:1].isdigit():
        try:
            parse_budget(s[1:].strip())
        except PipelineError as e:
            raise (not_positive if "must be positive" in str(e) else bad) from None
        raise not_positive
    if m := re.fullmatch(r"(\d+(?:\.\d+)?)\s*(h|min|m|s)", s):
        kind, amount = "time", float(m[1]) * _TIME[m[2]]
    elif m := re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kKMGB]?)\s*(?:tok|tokens)", s) or \
            re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMGB])", s):
        kind, amount = "tokens", float(m[1]) * _SCALE[m[2]]
    elif m := re.fullmatch(r"(\d+)\s*(?:steps?)?", s):
        kind, amount = "steps", float(int(m[1]))
    else:
        raise bad
    if not math.isfinite(amount):
        raise bad
    if amount <= 0:
        raise not_positive
    return Budget(kind, amount, s)


def auto_epochs(steps_per_epoch: int) -> int:
    """The default: the fewest epochs that reach MIN_STEPS steps, 1..MAX_EPOCHS."""
    return max(1, min(MAX_EPOCHS, math.ceil(MIN_STEPS / max(1, steps_per_epoch))))


def choose_length(*, epochs: int | None, budget: Budget | None, max_steps: int | None, steps_per_epoch: int,
                  tokens_per_epoch: int, seconds_per_step: float | None = None) -> dict:
    """{"epochs", "total_steps", "why"}: the epochs to pack and the optimizer steps to run (a
    budget's last epoch may be partial). `seconds_per_step` is the calibrated pace a time budget
    needs."""
    if budget is not None:
        if budget.kind == "steps":
            steps = int(budget.amount)
            why = f"--budget {budget.text}"
        elif budget.kind == "tokens":
            steps = max(1, round(budget.amount * steps_per_epoch / max(1, tokens_per_epoch)))
            why = f"--budget {budget.text} at {tokens_per_epoch / steps_per_epoch:,.0f} tokens/step"
        else:
            if seconds_per_step is None:
                raise ValueError("a time budget needs the calibrated seconds per step")
            steps = max(1, int(budget.amount / seconds_per_step))
            why = f"--budget {budget.text} at {seconds_per_step:.3g} s/step (calibrated on the first steps)"
        n_epochs = math.ceil(steps / steps_per_epoch)
    elif epochs is not None:
        n_epochs, steps = epochs, epochs * steps_per_epoch
        why = f"--epochs {epochs}"
    else:
        n_epochs = auto_epochs(steps_per_epoch)
        steps = n_epochs * steps_per_epoch
        why = (f"default: epochs to reach {MIN_STEPS} steps at {steps_per_epoch} steps/epoch, "
               f"at most {MAX_EPOCHS} (--epochs or --budget to choose)")
    if max_steps is not None and max_steps < steps:
        steps, why = max_steps, f"{why}; --max-steps {max_steps}"
    return {"epochs": n_epochs, "total_steps": steps, "why": why}



def default_lr(width: int) -> float:
    """The default peak lr for a draft `width` wide (its hidden size)."""
    return LR_REF * (LR_REF_WIDTH / width) ** LR_WIDTH_EXPONENT


def choose_lr(lr: float | None, width: int) -> dict:
    """{"lr", "lr_why"}: `--lr`, or the default for the draft's width."""
    if lr is not None:
        return {"lr": float(lr), "lr_why": "--lr"}
    return {"lr": float(f"{default_lr(width):.3g}"),
            "lr_why": f"default: {LR_REF:g} x ({LR_REF_WIDTH} / draft width {width})^{LR_WIDTH_EXPONENT:g}"}
