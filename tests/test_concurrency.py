"""01b --concurrency auto: the pure controller (generate/concurrency.py:next_level) on stand-in
readings that move on cue, the gauges parsed from vLLM's /metrics, and the driver against a
stand-in server whose simulated KV cache fills and preempts (tests/fault_server.py --kv-slots)."""

from __future__ import annotations

import json

from eagle3_train.common.server_metrics import gauges
from eagle3_train.generate import concurrency as cc
from helpers_generate import FaultServer, read_records, run_gen, write_prompts


class Feed:
    """Readings one window (1 s) apart; `tok` generated and `pre` preempted in each window."""

    def __init__(self, state: cc.Control):
        self.state, self.t, self.gen, self.pre = state, 0.0, 0.0, 0.0
        self.levels = [state.level]

    def read(self, *, kv=0.5, waiting=0, tok=1000.0, pre=0, inflight=None, running=None):
        self.t += 1.0
        self.gen += tok
        self.pre += pre
        level = self.state.level
        r = cc.Reading(t=self.t, kv=kv, running=level if running is None else running, waiting=waiting,
                       preemptions=self.pre, generated=self.gen, inflight=level if inflight is None else inflight)
        self.state = cc.next_level(self.state, r)
        self.levels.append(self.state.level)
        return self.state.level


def test_start_level():
    assert cc.start(256).level == cc.START == 8
    assert cc.start(4).level == 4  # --max-concurrency bounds the start too


def test_room_grows_waiting_holds_storm_backs_off_recovery_grows_again():
    f = Feed(cc.start(256))
    f.read(inflight=0)  # the baseline: nothing in flight yet
    assert f.state.level == 8
    # room in the cache, nothing waiting: doubling
    assert [f.read(kv=0.2), f.read(kv=0.4)] == [16, 32]
    # requests wait although the cache has room: the server's batch is the limit, hold
    assert [f.read(kv=0.5, waiting=5) for _ in range(3)] == [32, 32, 32]
    assert "batch" in f.state.why
    # a preemption storm (one per 10 generated tokens): back off by a quarter
    assert f.read(kv=1.0, waiting=4, pre=100) == 24
    assert f.state.limited and f.state.ceiling == 32 and "storm" in f.state.why
    # recovered: room again; grows by a quarter now (the cache filled once), never back to the storm's level
    assert [f.read(kv=0.6) for _ in range(4)] == [30, 31, 31, 31]
    assert "worse" in f.state.why
    # once COOL readings pass, the level found worse may be tried again
    for _ in range(cc.COOL):
        f.read(kv=0.6)
    assert f.state.level > 32 and f.state.ceiling is None


def test_cache_full_keeps_the_level_with_the_best_goodput():
    f = Feed(cc.Control(level=10, high=256, limited=True))
    # the cache is the limit: a peak at 15, 16 within TOLERANCE of it, 17 and 18 worse
    goodput = {10: 1000.0, 12: 1200.0, 15: 1300.0, 16: 1250.0, 17: 1150.0, 18: 1000.0}
    for _ in range(24):
        f.read(kv=0.97, waiting=2, tok=goodput.get(f.state.level, 900.0))
    for _ in range(6):
        f.read(kv=0.97, waiting=2, tok=goodput.get(f.state.level, 900.0))
    # up by a quarter, three windows each, past the peak; back to the best; the untried levels between
    assert f.levels[:19] == [10, 10, 10, 12, 12, 12, 15, 15, 15, 18, 18, 18, 15, 15, 15, 17, 17, 17, 15]
    assert f.levels[-10:] == [16] * 10 and f.state.ceiling == 17  # holds a level as good as the best
    assert cc.goodput(f.state) == goodput  # tokens / seconds over the windows counted at each level
    assert f.state.why == "at the best level found"


def test_a_full_cache_keeps_the_queue_between_one_and_two_batches():
    f = Feed(cc.Control(level=40, high=256, limited=True))
    f.read(kv=1.0, running=12, waiting=28)
    assert f.read(kv=1.0, running=12, waiting=28) == 40  # measuring first
    assert f.read(kv=1.0, running=12, waiting=28) == 30  # 28 wait for 12 running: over-admission
    assert "fewer in flight" in f.state.why
    for _ in range(3):
        f.read(kv=1.0, running=15, waiting=15)
    assert f.state.level == 30 and "refill" in f.state.why  # as many wait as run: no probe up
    for _ in range(3):
        f.read(kv=1.0, running=20, waiting=10)
    assert f.state.level == 37  # a shorter queue: goodput decides, up by a quarter


def test_a_full_cache_is_measured_for_three_windows_before_moving():
    f = Feed(cc.Control(level=10, high=256))
    assert [f.read(kv=0.95) for _ in range(5)] == [10, 10, 12, 12, 12]
    assert f.state.why == "measuring"


def test_a_storm_is_preemptions_per_generated_token():
    f = Feed(cc.Control(level=12, high=256, limited=True))
    f.read(kv=1.0)
    level = f.read(kv=1.0, pre=60, tok=1000)  # 1 in 17: a cost a full cache may pay (goodput decides)
    assert level == 12 and "storm" not in f.state.why
    assert f.read(kv=1.0, pre=70, tok=1000) == 9  # 1 in 14: back off by a quarter


def test_a_lowered_level_drains_before_the_next_decision():
    f = Feed(cc.Control(level=32, high=256, limited=True))
    f.read(kv=1.0)
    assert f.read(kv=1.0, pre=100) == 24
    # the 32 requests in flight finish at their pace, still preempting: no second back-off meanwhile
    assert [f.read(kv=1.0, pre=100, inflight=n) for n in (31, 28, 25)] == [24, 24, 24]
    assert f.state.why == "draining to a lower level"
    assert f.read(kv=1.0, pre=100, inflight=24) == 18  # drained: the storm is this level's own


def test_bounds_never_above_max_never_below_one():
    f = Feed(cc.start(20))
    for _ in range(10):
        f.read(kv=0.1)
    assert f.state.level == 20 and max(f.levels) == 20
    f = Feed(cc.Control(level=2, high=20))
    for _ in range(6):
        f.read(kv=1.0, pre=100, tok=10)
    assert f.state.level == 1 and min(f.levels) == 1


def test_tail_of_the_run_and_a_restarted_server_change_nothing():
    f = Feed(cc.Control(level=16, high=256))
    assert [f.read(kv=0.1, inflight=5) for _ in range(3)] == [16, 16, 16]  # fewer left than the level
    assert "tail" in f.state.why
    f.read(kv=0.1)
    assert f.state.level == 32
    # counters that went back (the server restarted): that window is no storm and no score
    f.state = cc.replace(f.state, prev=cc.replace(f.state.prev, preemptions=1e6, generated=1e9))
    assert f.read(kv=0.1, pre=0) == 64 and [lv for lv, *_ in f.state.scores] == [16]


def test_history_is_bounded_and_downsampled():
    h = cc.History(limit=10)
    for i in range(1000):
        h.add({"t": i})
    assert len(h.points) <= 10 and h.points[0]["t"] == 0
    ts = [p["t"] for p in h.points]
    assert ts == sorted(ts) and ts[1] - ts[0] == h.stride and ts[-1] >= 1000 - 2 * h.stride


VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 12.0
vllm:num_requests_running{engine="1",model_name="m"} 10.0
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 3.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.93
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.71
# TYPE vllm:num_preemptions counter
vllm:num_preemptions_total{engine="0",model_name="m"} 45.0
vllm:num_preemptions_created{engine="0",model_name="m"} 1.7e+09
vllm:num_preemptions_total{engine="1",model_name="m"} 5.0
vllm:generation_tokens_total{engine="0",model_name="m"} 123456.0
vllm:generation_tokens_total{engine="1",model_name="m"} 1000.0
"""


def test_gauges_from_vllm_metrics_text():
    """vLLM 0.32's names (vllm/v1/metrics/loggers.py; prometheus_client adds _total to counters);
    data-parallel engines: counts summed, the cache use of the fullest engine."""
    assert gauges(VLLM_METRICS) == {"running": 22.0, "waiting": 3.0, "preemptions": 50.0,
                                    "generated": 124456.0, "kv": 0.93}
    assert gauges("vllm:num_requests_running 1\n") is None  # an older or other server: no controller
    assert gauges("") is None


def test_auto_on_a_server_that_fills_its_cache(tmp_path):
    """The real driver against two stand-in servers: one whose simulated cache holds 12 answers
    (gauges on /metrics; more than 12 in flight preempt and slow every answer more than the extra
    ones gain: the goodput falls), one without
    /metrics (a fixed level, one line). The steered level grows while the cache has room, backs off
    from the preemptions, and every id is answered once, each prompt sent once (no request cancelled)."""
    n = 400
    prompts = write_prompts(tmp_path / "p.jsonl", [f"question {i}" for i in range(n)])
    out = tmp_path / "gen"
    with FaultServer(tmp_path, "--kv-slots", "12", "--delay", "0.3") as a, \
            FaultServer(tmp_path, "--delay", "2") as b:
        r = run_gen(prompts, out, [a.url, b.url], "--concurrency-every", "0.2", "--max-concurrency", "40",
                    "--max-retries", "0")
        sent = [q["text"] for q in a.requests() + b.requests() if "text" in q]
    assert r.returncode == 0, r.stderr
    raw = read_records(out / "raw_responses.jsonl")
    assert sorted(x["id"] for x in raw) == sorted(f"q{i:03d}" for i in range(n))
    assert sorted(sent) == sorted(f"question {i}" for i in range(n))  # none sent twice, none cut
    assert f"note: {b.url}: no vLLM load gauges at http://127.0.0.1:{b.port}/metrics (HTTP 404); " \
           "--concurrency auto keeps a fixed 40 requests in flight there" in r.stdout  # 64, within --max-concurrency
    m = json.loads((out / "manifest.json").read_text())
    assert m["config"]["concurrency"] == "auto" and m["config"]["max_concurrency"] == 40
    rec = m["this_run"]["concurrency"]
    assert rec["setting"] == "auto" and rec["endpoints"][b.url] == {"mode": "fixed", "level": 40, "why": "HTTP 404"}
    ep = rec["endpoints"][a.url]
    levels = [p["level"] for p in ep["history"]]
    assert set(ep["history"][0]) == {"t", "level", "kv", "running", "waiting", "preemptions", "tok_s"}
    top = levels.index(max(levels))
    assert levels[0] == 8 and max(levels) > 12 and ep["max"] <= 40  # grew past what the cache holds ...
    assert min(levels[top:]) < max(levels)  # ... and backed off
    assert ep["history"][-1]["preemptions"] > 0
    log = (out / "progress.log").read_text()
    assert "level " in log and "kv " in log and "preempt " in log
