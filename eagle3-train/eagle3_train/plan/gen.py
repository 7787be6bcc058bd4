"""00's model of 01b at `--concurrency auto`: how long the answers are, how many of them the KV
cache holds at once, and the tok/s a server makes at that many. Pure arithmetic, torch-free.

  answers   the answers' length distribution (count, mean, p50, p90, p99, max) and `resident`, the
            tokens an answer in flight holds in the cache on average: a random moment falls in an
            answer with probability proportional to its length, half-way through it on average, so
            E[a^2] / (2 E[a]); measured (lengths) or an assumed reasoning distribution
  level     what the controller settles at: the cache filled by answers' *typical* residency
            (prompt + resident), never below the worst case (every answer prompt + max tokens)
  curve     tok/s against answers in flight: the public figures for the user's box class, assumed,
            or measured points (the pilot's gen_rates.json), which replace the assumption where given
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from statistics import NormalDist

from eagle3_train.common.errors import PipelineError
from eagle3_train.common.server_metrics import fitting_concurrency

# Public measurements of 8x RTX PRO 6000 serving Kimi-K2.5/K2.6 INT4 with vLLM at TP 8 (TRITON_MLA):
# aggregate decode tok/s at answers in flight, short context (the 128 point runs an EAGLE-3 draft,
# so it bounds plain decode from above).
BOX_CURVE = ((1, 98.0), (32, 1130.0), (128, 2250.0))
BOX_SOURCE = ("assumed: 8x RTX PRO 6000 Kimi-K2.5 INT4 TP 8, public figures 98 tok/s at 1, 1,130 at 32 "
              "(fp8 KV, short context), 2,250 at 128 (with an EAGLE-3 draft), interpolated")
# The same box at 16k context: 340 tok/s at 8 and 490 at 16, against 425 and 693 on the short-context
# curve: ~0.75x. Decode reads each answer's whole cache every step, so the rate falls with context;
# assumed linear between a short context and 16k, and held beyond.
SHORT_CONTEXT, LONG_CONTEXT, LONG_FACTOR = 2048, 16384, 0.75
AUTO_MAX = 256  # 01b's --max-concurrency default: auto never goes above it
FIXED_LEVELS = (12, 32, 64, 128)  # the fixed --concurrency a user might pick, printed beside auto
# The assumed answers: lognormal (reasoning lengths have a long right tail), spread sigma, cut at max
# tokens (finish_reason length), its mean the run's answer tokens.
REASONING_SIGMA = 1.0
GRID = 1000  # quantiles of the assumed distribution


# ----------------------------------------------------------------------------- the answers

def percentile(sorted_values: list[int], q: float) -> int:
    """The nearest-rank q-th percentile (q in [0, 100]) of an ascending list."""
    i = max(0, math.ceil(q / 100 * len(sorted_values)) - 1)
    return sorted_values[min(i, len(sorted_values) - 1)]


def length_stats(lengths, source: str) -> dict:
    """count, mean, p50, p90, p99, max and `resident` (E[a^2] / 2E[a]) of answer lengths in tokens."""
    xs = sorted(int(x) for x in lengths)
    if not xs or sum(xs) <= 0:
        raise PipelineError(f"{source}: no answer with tokens to measure lengths from")
    total = sum(xs)
    return {"count": len(xs), "mean": round(total / len(xs), 1), "p50": percentile(xs, 50),
            "p90": percentile(xs, 90), "p99": percentile(xs, 99), "max": xs[-1],
            "resident": round(sum(x * x for x in xs) / (2 * total), 1), "source": source}


def assumed_lengths(mean: float, max_tokens: int, sigma: float = REASONING_SIGMA, n: int = GRID) -> list[int]:
    """n quantiles of a lognormal of spread `sigma` cut at `max_tokens`, whose mean after the cut is
    `mean` (bisection on the lognormal's location; a mean at or above max_tokens: every answer cut)."""
    if mean >= max_tokens:
        return [max_tokens] * n
    z = [NormalDist().inv_cdf((i + 0.5) / n) for i in range(n)]

    def grid(mu):
        return [min(max_tokens, max(1, round(math.exp(mu + sigma * x)))) for x in z]

    lo, hi = math.log(max(mean, 1.0)) - 5 * sigma, math.log(max_tokens) + 5 * sigma
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(grid(mid)) / n < mean else (lo, mid)
    return grid((lo + hi) / 2)


def assumed_answers(mean: float, max_tokens: int) -> dict:
    stats = length_stats(assumed_lengths(mean, max_tokens), "assumed")
    return stats | {"count": None, "source": (f"assumed: reasoning answers, lognormal (sigma {REASONING_SIGMA}) "
                                              f"of mean {mean:,.0f} cut at --gen-max-tokens {max_tokens:,}")}


# ----------------------------------------------------------------------------- the level

def auto_level(cache_tokens: int, prompt: int, answers: dict, max_tokens: int, cap: int = AUTO_MAX) -> dict:
    """Answers in flight per server: `worst` keeps every answer resident to its max tokens (prompt +
    max_tokens each); `fill` fills the cache with their typical residency (prompt + answers' resident),
    `auto` is that at most `cap`; 0 where not one answer of prompt + max_tokens fits (vLLM refuses
    to start)."""
    worst = fitting_concurrency(cache_tokens, prompt + max_tokens)
    typical = prompt + answers["resident"]
    fill = max(worst, int(cache_tokens // typical)) if worst else 0
    return {"worst": worst, "auto": min(cap, fill), "fill": fill, "typical_tokens": round(typical),
            "mean_level": int(cache_tokens // (prompt + answers["mean"])) if worst else 0}


# ----------------------------------------------------------------------------- tok/s against the level

def context_factor(context: float) -> float:
    """The short-context curve's share at a mean context (BOX_CURVE's 16k figures)."""
    if context <= SHORT_CONTEXT:
        return 1.0
    return 1.0 - (1.0 - LONG_FACTOR) * (min(context, LONG_CONTEXT) - SHORT_CONTEXT) / (LONG_CONTEXT - SHORT_CONTEXT)


def interpolate(points, level: float) -> float:
    """tok/s at `level` on a curve of (level, tok/s) points: linear in log-log between points (rates
    grow like a power of the batch), proportional to the level below the first (each answer at the
    first point's per-answer rate), flat above the last (no figure says it grows further)."""
    pts = sorted((float(c), float(r)) for c, r in points)
    if level <= 0:
        return 0.0
    if level <= pts[0][0]:
        return pts[0][1] * level / pts[0][0]
    for (c1, r1), (c2, r2) in zip(pts, pts[1:]):
        if level <= c2:
            return r1 * (level / c1) ** (math.log(r2 / r1) / math.log(c2 / c1))
    return pts[-1][1]


def _log_interp(points, level: float) -> float:
    """A ratio between measured points, linear in log(level), held flat outside them."""
    pts = sorted(points)
    if level <= pts[0][0]:
        return pts[0][1]
    for (c1, y1), (c2, y2) in zip(pts, pts[1:]):
        if level <= c2:
            return y1 + (y2 - y1) * math.log(level / c1) / math.log(c2 / c1)
    return pts[-1][1]


def gen_tok_s(level: float, context: float, measured=None) -> float:
    """One server's tok/s with `level` answers in flight at a mean `context`: the box's assumed curve,
    or, given measured (level, tok/s) points, that curve scaled by measured/assumed at the nearest
    points (exactly the measured rate at a measured level; the assumed shape between and beyond)."""
    model = interpolate(BOX_CURVE, level) * context_factor(context)
    if not measured:
        return model
    ratios = [(c, r / (interpolate(BOX_CURVE, c) * context_factor(context))) for c, r in measured]
    return model * _log_interp(ratios, level)


def curve_source(measured, where: str | None) -> str:
    if not measured:
        return BOX_SOURCE + "; tok/s x0.75 at 16k context (public: 340 at 8, 490 at 16)"
    pts = ", ".join(f"{r:,.0f} at {c:g}" for c, r in sorted(measured))
    return f"measured ({where}): {pts} tok/s; the assumed curve's shape between and beyond"


# ----------------------------------------------------------------------------- the measured file

def read_measured(path: Path) -> dict:
    """The pilot's gen_rates.json (or one of the same shape): {"points": [{"level", "tok_s"}...],
    "answers": {count, mean, p50, p90, p99, max, resident}, optional "cache_tokens" per server,
    "prompt_tokens" mean}. One `error:` line naming --measured when it is not that."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise PipelineError(f"--measured {path}: no such file (the pilot writes <work-dir>/pilot/gen_rates.json)") \
            from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PipelineError(f"--measured {path}: not JSON ({e})") from None
    points = data.get("points") if isinstance(data, dict) else None
    ok = isinstance(points, list) and all(
        isinstance(p, dict) and isinstance(p.get("level"), int | float) and p["level"] > 0
        and isinstance(p.get("tok_s"), int | float) and p["tok_s"] > 0 for p in points)
    answers = data.get("answers") if isinstance(data, dict) else None
    if not ok or (answers is not None and not (isinstance(answers, dict) and (answers.get("mean") or 0) > 0
                                               and (answers.get("resident") or 0) > 0)):
        raise PipelineError(f"--measured {path}: not a gen_rates.json (points: [{{level, tok_s}}] with positive "
                            "numbers, answers: {mean, resident, ...}); the pilot writes one")
    return data
