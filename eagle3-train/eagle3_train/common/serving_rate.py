"""Output tok/s a draft serves at, modelled from forward times (pure arithmetic, torch-free).

A speculative step at concurrency c: the draft proposes K tokens for each of c sequences, the target
verifies 1 + K tokens a sequence in one forward, and a sequence keeps E[accepted] + 1 tokens (the
accepted run and the target's bonus token). So

    output tok/s a sequence = (E[accepted] + 1) / (t_verify + t_draft),   aggregate = c x that

with E[accepted] = p1 + ... + pK, pJ the share of drafts whose first J tokens were accepted (05's
per-position rate, vLLM's own count). What the two draft families cost a step differs:

  eagle3   K sequential draft forwards: the first over the c x (1 + K) tokens the target verified
           (vLLM 0.32's GPU runner runs the draft's first pass over the verify's batch, its
           attention metadata reused), then K - 1 of c tokens;
  dflash   one forward of c x (1 + K) query tokens (the bonus token and K mask slots, the whole
           block at once) plus the verified context (c x (1 + K) tokens whose keys and values the
           draft layers compute from the target's states; counted as whole tokens, an upper bound).

Forward times come from a `Forward`: a small table of (tokens in flight, ms), measured or modelled
(plan/forward.py models the user's box), plus the time of reading the KV cache, per query row or per
sequence. Interpolation is linear between points; below the first point the first point's time (a
forward never costs less than its smallest measured one: launches and all-reduces), beyond the last
the last segment's slope (the compute-bound side grows linearly with tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

from eagle3_train.common.errors import PipelineError

ARCHS = ("eagle3", "dflash")
KV_PER = ("row", "seq")


@dataclass(frozen=True)
class Forward:
    """One model's forward time: `points` ((tokens, ms), ascending) for everything but the KV
    cache's reads; `kv_ms` for reading one sequence's cache, once per query row (`kv_per` "row":
    a backend that runs a program per query token) or once per sequence ("seq"); `source` says
    where the figures come from."""
    points: tuple[tuple[float, float], ...]
    kv_ms: float = 0.0
    kv_per: str = "seq"
    source: str = ""

    def table_ms(self, tokens: float) -> float:
        pts = self.points
        if tokens <= pts[0][0]:
            return pts[0][1]
        for (n1, t1), (n2, t2) in zip(pts, pts[1:]):
            if tokens <= n2:
                return t1 + (t2 - t1) * (tokens - n1) / (n2 - n1)
        (n1, t1), (n2, t2) = pts[-2], pts[-1]
        return t2 + (t2 - t1) * (tokens - n2) / (n2 - n1)

    def ms(self, tokens: float, seqs: float) -> float:
        """A forward of `tokens` query tokens over `seqs` sequences."""
        reads = tokens if self.kv_per == "row" else seqs
        return self.table_ms(tokens) + self.kv_ms * reads


def forward(points, what: str, *, kv_ms: float = 0.0, kv_per: str = "seq", source: str = "") -> Forward:
    """A checked Forward; a table that cannot be a forward's times is refused in one line naming
    `what` (where it came from)."""
    fix = "give [[tokens, ms], ...] with tokens > 0 ascending and ms > 0 never falling"
    try:
        pts = [(float(n), float(t)) for n, t in points]
    except (TypeError, ValueError):
        raise PipelineError(f"{what}: not a table of (tokens, ms) pairs: {fix}") from None
    if len(pts) < 2:
        raise PipelineError(f"{what}: {len(pts)} point(s); the table needs 2 or more to interpolate: {fix}")
    bad = [p for p in pts if not (p[0] > 0 and p[1] > 0) or p[0] != p[0] or p[1] != p[1]]
    if bad:
        raise PipelineError(f"{what}: ({bad[0][0]:g}, {bad[0][1]:g}) is not a positive token count and time: {fix}")
    pts.sort()
    for (n1, t1), (n2, t2) in zip(pts, pts[1:]):
        if n1 == n2:
            raise PipelineError(f"{what}: {n1:g} tokens given twice: {fix}")
        if t2 < t1:
            raise PipelineError(f"{what}: {n2:g} tokens take {t2:g} ms, less than {n1:g} tokens' {t1:g} ms "
                                f"(a forward of more tokens is not faster): {fix}")
    if kv_per not in KV_PER:
        raise PipelineError(f"{what}: kv_per must be one of {', '.join(KV_PER)}, not {kv_per!r}")
    if not kv_ms >= 0:
        raise PipelineError(f"{what}: kv_ms must be 0 or more, not {kv_ms!r}")
    return Forward(tuple(pts), float(kv_ms), kv_per, source)


def expected_accepted(rates, k: int, what: str = "per-position rates") -> float:
    """E[accepted] at K from cumulative per-position rates (p1 >= p2 >= ...: 05's and vLLM's
    per_position_rate, the share of drafts whose first J tokens were accepted)."""
    rates = list(rates)
    if k < 1 or k > len(rates):
        raise PipelineError(f"{what}: K = {k} needs rates for positions 1..{k}; {len(rates)} given")
    if any(not 0.0 <= p <= 1.0 for p in rates):
        raise PipelineError(f"{what}: every rate is a share in [0, 1], got {rates}")
    if any(b > a for a, b in zip(rates, rates[1:])):
        raise PipelineError(f"{what}: rates must not rise with the position (p_J counts drafts whose first J "
                            f"tokens were all accepted), got {rates}")
    return float(sum(rates[:k]))


def draft_ms(arch: str, k: int, c: int, draft: Forward) -> float:
    """One step's draft time for c sequences at K (see the module's doc for what each arch runs)."""
    verified = c * (1 + k)
    if arch == "eagle3":
        return draft.ms(verified, c) + (k - 1) * draft.ms(c, c)
    if arch == "dflash":
        return draft.ms(2 * verified, c)
    raise PipelineError(f"draft arch must be one of {', '.join(ARCHS)}, not {arch!r}")


def plain_tok_s(c: int, target: Forward) -> float:
    """Aggregate output tok/s without drafting: one target forward of c tokens yields c tokens."""
    return c / target.ms(c, c) * 1000.0


def serve_rate(arch: str, rates, k: int, c: int, target: Forward, draft: Forward) -> dict:
    """The modelled step at K and concurrency c: AL, verify / draft / step ms, output tok/s a
    sequence and in all, and the speed-up over no drafting at the same c."""
    if c < 1:
        raise PipelineError(f"concurrency must be 1 or more, not {c}")
    acc = expected_accepted(rates, k, f"{arch} rates")
    verify = target.ms(c * (1 + k), c)
    drafted = draft_ms(arch, k, c, draft)
    step = verify + drafted
    per_seq = (acc + 1) / step * 1000.0
    return {"arch": arch, "k": k, "concurrency": c, "acceptance_length": 1 + acc, "verify_ms": verify,
            "draft_ms": drafted, "step_ms": step, "tok_s_seq": per_seq, "tok_s": c * per_seq,
            "speedup": c * per_seq / plain_tok_s(c, target)}


def best(rows: list[dict]) -> dict:
    """The row with the highest aggregate tok/s (a modelled figure has no noise: no ties kept)."""
    return max(rows, key=lambda r: (r["tok_s"], -r["k"]))
