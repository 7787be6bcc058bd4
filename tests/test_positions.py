"""Acceptance by position: positions.py's buckets and counts, and 04's validation and 05's offline
walk placing each draft where vLLM's per-request record would (its first drafted token's position
in prompt + answer), in their own frames: 05's shifted one, 04's packed rows and windows."""

from __future__ import annotations

import random

import pytest
import torch
from eagle3_train.common import positions
from eagle3_train.common.acceptance import chain_acceptance, draft_correctness, merge, walk_positions
from eagle3_train.common.errors import PipelineError
from eagle3_train.common.hidden_store import SampleStates
from eagle3_train.evaluate import offline
from eagle3_train.evaluate.offline import first_drafted as first_drafted_05
from eagle3_train.evaluate.offline import offline_eval
from eagle3_train.train.data import collate
from eagle3_train.train.objective import acceptance_stats, first_drafted, prepare
from helpers import SampleStore

# ----------------------------------------------------------------------------- positions.py


def test_parse_edges_reads_k_and_whitespace():
    assert positions.parse_edges("512,2k,8k,16k") == positions.EDGES == (0, 512, 2048, 8192, 16384)
    assert positions.parse_edges(" 100 , 1K") == (0, 100, 1024)
    assert positions.parse_edges(positions.BUCKETS) == positions.EDGES


@pytest.mark.parametrize("text,why", [("0,512", "positive and ascending"), ("512,256", "positive and ascending"),
                                      ("512,512", "positive and ascending"), ("-1", "positive and ascending"),
                                      ("abc", "not a whole number"), ("1.5k", "not a whole number"),
                                      ("k", "not a whole number"), ("", "empty boundary"),
                                      ("512,,2k", "empty boundary")])
def test_parse_edges_refuses_bad_values(text, why):
    with pytest.raises(ValueError, match=why):
        positions.parse_edges(text)
    with pytest.raises(PipelineError, match=f"^--position-buckets: .*{why}.*e.g. 512,2k,8k,16k$"):
        positions.edges_of_flag(text)


def test_labels():
    assert positions.labels() == ["0-512", "512-2k", "2k-8k", "8k-16k", "16k+"]
    assert positions.labels((0, 100, 1536, 3072)) == ["0-100", "100-1536", "1536-3k", "3k+"]


def test_bucket_of_at_the_edges():
    got = {p: positions.bucket_of(p) for p in (0, 511, 512, 2047, 2048, 8191, 8192, 16383, 16384, 10**6)}
    assert got == {0: 0, 511: 0, 512: 1, 2047: 1, 2048: 2, 8191: 2, 8192: 3, 16383: 3, 16384: 4, 10**6: 4}
    assert positions.bucket_of(5, (0, 5)) == 1 and positions.bucket_of(4, (0, 5)) == 0


def test_count_sums_drafts_accepted_and_hits_per_bucket():
    c = positions.count([3, 511, 512, 600, 20000], [0, 3, 2, 5, 1], k=3)  # 5 > k counts as k
    assert c["drafts"] == [2, 2, 0, 0, 1]
    assert c["accepted"] == [3, 5, 0, 0, 1]
    assert c["hits"] == [[1, 1, 1], [2, 2, 1], [0, 0, 0], [0, 0, 0], [1, 0, 0]]
    assert (c["k"], c["edges"]) == (3, list(positions.EDGES))


def test_merge_flatten_unflatten_round_trip():
    rng = random.Random(3)
    pos = [rng.randrange(0, 20000) for _ in range(300)]
    acc = [rng.randrange(0, 5) for _ in range(300)]
    whole = positions.count(pos, acc, 4)
    parts = [positions.count(pos[:100], acc[:100], 4), positions.count(pos[100:], acc[100:], 4)]
    assert positions.merge(parts) == whole
    assert positions.merge([*parts, {}]) == whole  # an empty part adds nothing
    flat = positions.flatten(whole)
    assert len(flat) == len(positions.EDGES) * (2 + 4)
    assert positions.unflatten([float(x) for x in flat], 4) == whole
    summed = [a + b for a, b in zip(positions.flatten(parts[0]), positions.flatten(parts[1]))]  # an all-reduce
    assert positions.unflatten(summed, 4) == whole
    with pytest.raises(ValueError, match="different bucket edges"):
        positions.merge([whole, positions.count(pos, acc, 4, (0, 100))])
    with pytest.raises(ValueError, match="nothing to merge"):
        positions.merge([])
    # a shallower part adds to the first steps of the deeper one
    m = positions.merge([positions.count([0], [2], 2), positions.count([0], [3], 3)])
    assert m["k"] == 3 and m["hits"][0] == [2, 2, 1] and m["accepted"][0] == 5


def test_step_positions_and_from_vllm_steps():
    # Prompt of 10 tokens: the prefill makes position 10, the first draft proposes 11 onwards; a step
    # accepting a moves the next draft a + 1 on (the bonus token).
    assert positions.step_positions(10, [2, 0, 3, 1]) == [11, 14, 15, 19]
    assert positions.step_positions(10, []) == []
    c = positions.from_vllm_steps(510, [0, 3, 1], [3, 3, 2], k=3)
    assert c == {**positions.count([511, 512, 516], [0, 3, 1], 3), "answers": [1, 1, 0, 0, 0]}
    assert c["drafts"][:2] == [1, 2]
    with pytest.raises(ValueError, match="differ in length"):
        positions.from_vllm_steps(10, [1, 2], [3], k=3)


def test_summarize_rates_and_few():
    c = positions.count([0] * 60 + [600] * 4, [3] * 30 + [1] * 30 + [2] * 4, k=3)
    rows = positions.summarize(c)
    assert [r["bucket"] for r in rows] == positions.labels() and [r["start"] for r in rows] == list(positions.EDGES)
    r0, r1, r2 = rows[:3]
    assert (r0["drafts"], r0["acceptance_length"], r0["few"]) == (60, 1 + 120 / 60, False)
    assert r0["per_position_rate"] == [1.0, 0.5, 0.5]
    assert (r1["drafts"], r1["acceptance_length"], r1["few"]) == (4, 3.0, True)
    assert (r2["drafts"], r2["acceptance_length"], r2["per_position_rate"], r2["few"]) == (0, None, None, True)
    assert positions.summarize(c, min_drafts=4)[1]["few"] is False
    assert positions.summarize(c, min_drafts=61)[0]["few"] is True
    b = positions.block(c)
    assert set(b) == {"edges", "counts", "rows"} and b["edges"] == list(positions.EDGES) and b["rows"] == rows


def test_answers_merge_only_when_every_part_counted_them_and_few_answers_is_marked():
    one = [positions.from_vllm_steps(10, [3] * 60, [3] * 60, k=3) for _ in range(3)]  # 3 answers, 60 drafts each
    m = positions.merge(one)
    assert m["answers"] == [3, 0, 0, 0, 0] and m["drafts"][0] == 180
    assert "answers" not in positions.merge([*one, positions.count([0], [1], 3)])  # a part counted otherwise
    rows = positions.summarize(m)
    assert rows[0]["answers"] == 3 and rows[0]["few"] is True  # 180 drafts, but from 3 answers
    assert positions.summarize(m, min_answers=3)[0]["few"] is False
    assert positions.summarize(positions.merge(one * 3))[0]["few"] is False  # 9 answers
    assert "answers" not in positions.summarize(positions.count([0] * 60, [1] * 60, 3))[0]
    lines = positions.table(rows).splitlines()
    assert lines[0] == "| position | drafts | answers | AL | p1 | p2 | p3 | note |"
    assert lines[2] == "| 0-512 | 180 | 3 | 4.000 | 1.000 | 1.000 | 1.000 | few answers |"
    assert lines[3] == "| 512-2k | 0 | 0 | - | - | - | - | no drafts |"
    many = positions.merge([positions.from_vllm_steps(10, [3], [3], k=3)] * 9)  # 9 answers, 9 drafts
    assert positions.table(positions.summarize(many)).splitlines()[2].endswith("| few drafts |")


def test_table():
    c = positions.count([0] * 60 + [600] * 4, [3] * 30 + [1] * 30 + [2] * 4, k=3)
    lines = positions.table(positions.summarize(c)).splitlines()
    assert lines[0] == "| position | drafts | AL | p1 | p2 | p3 | note |"
    assert lines[1] == "|---|---|---|---|---|---|---|"
    assert lines[2] == "| 0-512 | 60 | 3.000 | 1.000 | 0.500 | 0.500 |  |"
    assert lines[3] == "| 512-2k | 4 | 3.000 | 1.000 | 1.000 | 0.000 | few drafts |"
    assert lines[4] == "| 2k-8k | 0 | - | - | - | - | no drafts |"
    assert len(lines) == 2 + len(positions.EDGES)
    assert "| p4 |" in positions.table(positions.summarize(c), k=4).splitlines()[0]


# ----------------------------------------------------------------------------- acceptance.py


def test_walk_positions_equals_counting_the_walk_one_draft_at_a_time():
    rng = random.Random(5)
    for _ in range(30):
        k, n = rng.randint(1, 4), rng.randint(1, 200)
        prefix = torch.cumprod(torch.tensor([[rng.random() < 0.7 for _ in range(n)] for _ in range(k)]).long(), 0)
        walk = torch.tensor([rng.random() < 0.5 for _ in range(n)])
        first = torch.tensor([rng.randrange(0, 3000) for _ in range(n)])
        edges = (0, 7, 100, 2048)
        idx = walk.nonzero().squeeze(1).tolist()
        want = positions.count([int(first[t]) for t in idx], [int(prefix[:, t].sum()) for t in idx], k, edges)
        assert walk_positions(prefix, walk, first, edges) == want


def test_chain_acceptance_by_position_sums_to_the_walks_counts():
    rng = random.Random(7)
    n, k = 400, 3
    mask = torch.tensor([0] * 20 + [1] * 150 + [0] * 30 + [1] * 200)
    ids = torch.arange(n)
    drafts = [torch.tensor([p if rng.random() < 0.6 else -1 for p in range(1 + j, n + 1 + j)]) for j in range(k)]
    correct, valid = draft_correctness(drafts, ids, mask)
    s = chain_acceptance(correct, valid, torch.arange(n) + 1, (0, 64, 128, 256))
    bp = s["by_position"]
    assert sum(bp["drafts"]) == s["drafts"] > 0 and sum(bp["accepted"]) == s["accepted"]
    assert [sum(h[j] for h in bp["hits"]) for j in range(k)] == s["hits"]
    assert "by_position" not in chain_acceptance(correct, valid)
    # merge sums the by-position counts with the rest
    m = merge([s, s])
    assert m["by_position"] == positions.merge([bp, bp]) and m["drafts"] == 2 * s["drafts"]


# ----------------------------------------------------------------------------- 05's and 04's frames

def right(token: int, pos: int, k: int) -> bool:
    """Whether the fake draft's step k proposing position `pos` (true token `token`) gets it right:
    a fixed pseudo-random rule, the same whichever frame asks."""
    return (token * 31 + pos * 7 + k * 3) % 5 != 0


def fake_step_tokens(model, samples: list, k: int, aux_index=None) -> list[list[torch.Tensor]]:
    """Stands in for offline.draft_step_tokens, in its frame (position j holds token j + 1): step k at
    j proposes token j + 2 + k of the sample when `right` says so, else a token that never matches."""
    out = []
    for s in samples:
        ids = s.input_ids
        n = len(ids) - 1
        steps = []
        for j in range(k):
            p = torch.full((n,), -5, dtype=ids.dtype)
            for t in range(n):
                if t + 2 + j < len(ids) and right(int(ids[t + 2 + j]), t + 2 + j, j):
                    p[t] = ids[t + 2 + j]
            steps.append(p)
        out.append(steps)
    return out


@pytest.fixture
def fake_draft(monkeypatch):
    monkeypatch.setattr(offline, "draft_step_tokens", fake_step_tokens)
    return object()


def sample(sid: str, prompt: int, answer: int, seed: int, hole: tuple[int, int] | None = None) -> SampleStates:
    """Greedy data (the target's top-1 is the next token), loss-masked from `prompt` on (minus `hole`)."""
    g = torch.Generator().manual_seed(seed)
    n = prompt + answer
    ids = torch.randint(0, 50, (n,), generator=g)
    mask = torch.zeros(n, dtype=torch.bool)
    mask[prompt:] = True
    if hole:
        mask[hole[0]:hole[1]] = False
    top = torch.cat([ids[1:], ids[:1]])[:, None]
    return SampleStates(sid, ids, mask, torch.randn(n, 1, 4, generator=g), None, top, torch.zeros(n, 1))


def walked_drafts(by_position: dict) -> tuple[list[int], list[int]]:
    """(positions, accepted) of each draft, from counts made with one bucket per position."""
    c = by_position["counts"] if "counts" in by_position else by_position
    assert all(d <= 1 for d in c["drafts"])
    at = [b for b, d in enumerate(c["drafts"]) if d]
    return [c["edges"][b] for b in at], [c["accepted"][b] for b in at]


def per_position(n: int) -> tuple[int, ...]:
    return tuple(range(n + 8))


def test_05_offline_positions_are_vllms_record(fake_draft):
    """For each sample alone: the positions offline_eval counted equal positions.step_positions of
    the prompt's length (the first generated token's index, the first loss-masked one) and the
    accepted counts of the same drafts, as vLLM's detailed record gives them."""
    k = 3
    for seed, (prompt, answer) in enumerate([(7, 40), (2, 25), (30, 90), (12, 5)]):
        s = sample(f"s{seed}", prompt, answer, seed)
        res = offline_eval(fake_draft, None, SampleStore([s]), [s.id], k, edges=per_position(prompt + answer))
        pos, acc = walked_drafts(res["by_position"])
        first_generated = int(s.loss_mask.nonzero()[0])
        assert first_generated == prompt and pos and pos[0] == prompt + 1
        assert positions.step_positions(first_generated, acc) == pos
        assert (len(pos), sum(acc)) == (res["drafts"], res["counts"]["accepted"])
        assert 0 < sum(acc) < k * len(acc)  # some drafts rejected, some accepted: the walk is exercised


def test_05_offline_restarts_the_record_at_each_supervised_run(fake_draft):
    k = 3
    s = sample("turns", 6, 60, 9, hole=(30, 40))  # answer 6..29, a user turn 30..39, answer 40..65
    res = offline_eval(fake_draft, None, SampleStore([s]), [s.id], k, edges=per_position(66))
    pos, acc = walked_drafts(res["by_position"])
    first = [(p, a) for p, a in zip(pos, acc) if p < 30]
    second = [(p, a) for p, a in zip(pos, acc) if p > 40]
    assert len(first) + len(second) == len(pos)
    assert positions.step_positions(6, [a for _, a in first]) == [p for p, _ in first]
    assert positions.step_positions(40, [a for _, a in second]) == [p for p, _ in second]


def test_05_offline_first_drafted_is_the_token_after_the_frames():
    # frame j holds token j + 1 (draft_step_tokens), its draft proposes token j + 2 first
    assert first_drafted_05(4).tolist() == [2, 3, 4, 5]


def validation_counts(store: SampleStore, items: list, k: int, edges) -> dict:
    """04's validation counts of one packed batch of `items`, drafted by `right`'s rule."""
    b = collate(store, items, None, [0])
    b = prepare(b, None, k)
    n = b.to_full.shape[0]
    ids, pos, doc = b.ids[0], b.pos[0], b.doc
    preds = []
    for j in range(k):
        p = torch.full_like(ids, -5)
        for t in range(n - 1 - j):
            if doc[t] == doc[t + 1 + j] and right(int(ids[t + 1 + j]), int(pos[t]) + 1 + j, j):
                p[t] = ids[t + 1 + j]
        preds.append(p)
    return acceptance_stats(b, preds, lambda x: x, edges)


def test_04_validation_counts_equal_05_offline_on_packed_rows(fake_draft):
    """The same drafts, counted by 04 over one packed row of documents and by 05 one sample at a
    time: the same by-position counts, at the default buckets and at one bucket per position."""
    k = 3
    samples = [sample(f"v{i}", p, a, 20 + i) for i, (p, a) in enumerate([(9, 50), (3, 70), (25, 40), (2, 12)])]
    store = SampleStore(samples)
    for edges in (positions.EDGES, (0, 16, 33, 60), per_position(80)):
        s04 = validation_counts(store, store.ids, k, edges)
        s05 = offline_eval(fake_draft, None, store, store.ids, k, tokens_per_batch=1, edges=edges)
        c05 = dict(s05["by_position"]["counts"])
        answers = c05.pop("answers")  # 05 counts one answer at a time, 04 a packed batch: only 05 knows them
        assert s04["by_position"] == c05 and "answers" not in s04["by_position"]
        alone = [offline_eval(fake_draft, None, store, [s.id], k, edges=edges)["by_position"]["counts"]["drafts"]
                 for s in samples]
        assert answers == [sum(d[b] > 0 for d in alone) for b in range(len(edges))]
        assert [r["answers"] for r in s05["by_position"]["rows"]] == answers
        assert answers[0] == len(samples) or edges != positions.EDGES  # every sample drafts before 512
        assert s04["drafts"] == s05["drafts"] == sum(s04["by_position"]["drafts"])
        assert s04["accepted"] == s05["counts"]["accepted"] == sum(s04["by_position"]["accepted"])
    # one document at a time, at one bucket per position: vLLM's record of that request
    for s in samples:
        c = validation_counts(SampleStore([s]), [s.id], k, per_position(80))["by_position"]
        pos, acc = walked_drafts(c)
        assert positions.step_positions(int(s.loss_mask.nonzero()[0]), acc) == pos


def test_04_first_drafted_uses_each_samples_own_positions_in_packed_rows_and_windows():
    s1, s2 = sample("a", 5, 30, 1), sample("b", 4, 60, 2)
    store = SampleStore([s1, s2])
    # s1 whole, then a window of s2 starting at its token 20 (live 30..50): packed after s1
    b = collate(store, [("a", 0, 35, 0, 35), ("b", 20, 64, 30, 50)], None, [0])
    fp = first_drafted(b).tolist()
    n1 = 35
    assert fp[1:n1] == list(range(2, 36))  # s1 token t: its draft proposes t + 1
    assert fp[n1 + 1:] == list(range(22, 65))  # s2 from 20: full index n1 + i holds token 20 + i
    # the walk's drafts stand inside the window's live part at those positions
    prepare(b, None, 3)
    stats = validation_counts(store, [("b", 20, 64, 30, 50)], 3, per_position(70))
    pos, _ = walked_drafts(stats["by_position"])
    assert pos and all(31 <= p <= 51 for p in pos)


def test_04_meter_sums_by_position_over_ranks_beside_the_rest():
    """Meter.reduce's one all-reduce: by-position counts after the chain's, a rank without a
    batch adding zeros of the same length (here: two ranks, one of them empty, then both alike)."""
    from eagle3_train.train.metrics import Meter

    class Ranks:  # d.sum over `world` ranks holding the same numbers (one rank: as it is)
        device = "cpu"

        def __init__(self, world):
            self.world = world

        def sum(self, t):
            return t * self.world

    k, edges = 3, (0, 16, 33)
    store = SampleStore([sample("m", 9, 50, 3)])
    chain = validation_counts(store, store.ids, k, edges)
    m = Meter(k, edges=edges)
    m.add(1.0, {"loss_sum": torch.zeros(k), "loss_cnt": torch.ones(k), "tokens": 10, "chain": chain})
    one, two = m.reduce(Ranks(1)), m.reduce(Ranks(2))
    assert one["by_position"] == positions.block(chain["by_position"]) and one["drafts"] == chain["drafts"]
    assert two["by_position"]["counts"] == positions.merge([chain["by_position"]] * 2)
    assert two["drafts"] == 2 * chain["drafts"] and two["acceptance_length"] == one["acceptance_length"]
    empty = Meter(k, edges=edges).reduce(Ranks(1))  # a rank with no validation batch
    assert empty["by_position"]["counts"] == positions.empty(k, edges)
    assert "by_position" not in Meter(k).reduce(Ranks(1))  # training's meter counts no positions


# ----------------------------------------------------------------------------- the flag


@pytest.mark.parametrize("script", ["04_train", "05_evaluate"])
@pytest.mark.parametrize("value", ["0,512", "512,256", "abc", ""])
def test_bad_position_buckets_is_one_error_line_and_writes_nothing(tmp_path, script, value, capfd):
    from reliability import assert_one_error_line, run_inprocess

    out = tmp_path / "out"
    argv = (["--hidden-states", tmp_path / "h", "--vocab-mapping", tmp_path / "v", "--target", "t"]
            if script == "04_train" else ["--draft", tmp_path / "d", "--store", tmp_path / "h"])
    res = run_inprocess(script, argv + ["--output-dir", out, "--position-buckets", value], capfd)
    assert assert_one_error_line(res, "--position-buckets", "512,2k,8k,16k").startswith("error: --position-buckets: ")
    assert not out.exists()
