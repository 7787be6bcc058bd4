"""02_extract_hidden_states, hf backend, on the tiny random Llama and DeepSeek-V3 (MLA + MoE)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from eagle3_train.common import hidden_store as hs
from eagle3_train.common.errors import PipelineError
from eagle3_train.common.manifest import read_manifest
from eagle3_train.extract import hf as extract_hf
from eagle3_train.extract import stage as extract
from helpers import make_training_set, script_path, stage_cli
from safetensors import safe_open
from safetensors.torch import load_file, save_file

SCRIPT = script_path("02_extract_hidden_states")
stage = stage_cli("02_extract_hidden_states")


@pytest.fixture(scope="module")
def tokset(tmp_path_factory, k25_tokenizer_dir):
    return make_training_set(tmp_path_factory.mktemp("tok") / "tokenized", k25_tokenizer_dir, n=10, seed=3)


def run02(inp, model, out, *extra):
    return stage.main(["--input", str(inp), "--model", str(model), "--output", str(out), *extra])


def load(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@torch.inference_mode()
def reference(model, input_ids, *, pre_norm_last: bool):
    """A plain HF forward of one unpadded sample with output_hidden_states=True."""
    # transformers 5.19 (utils/output_capturing.py, tie_last_hidden_states=True by default) replaces
    # hidden_states[-1] with last_hidden_state, i.e. the output AFTER the final norm. Our id N is the
    # last layer's output BEFORE the norm, which HF returns only with tie_last_hidden_states=False.
    model.config.tie_last_hidden_states = not pre_norm_last
    return model(torch.tensor([input_ids]), output_hidden_states=True)


def records(inp):
    return [json.loads(line) for line in (Path(inp) / "data.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("arch", ["llama", "deepseek_v3"])
def test_stored_states_equal_the_plain_forward(tmp_path, tokset, arch, llama_target_dir, deepseek_target_dir):
    target = {"llama": llama_target_dir, "deepseek_v3": deepseek_target_dir}[arch]
    out = tmp_path / "hs"
    # Small batches of unequal lengths: padding and batching must not change any stored value.
    assert run02(tokset, target, out, "--storage", "fp32", "--dtype", "float32", "--batch-tokens", "300",
                 "--shard-mb", "0.2", "--device", "cpu") == 0
    store = hs.HiddenStates(out)
    N = {"llama": 8, "deepseek_v3": 6}[arch]
    aux_ids = {8: [2, 4, 5], 6: [2, 3, 4]}[N]  # vLLM's (2, N//2, N-3), distinct: (2, 3, 3) at N = 6
    assert store.layer_ids == [*aux_ids, N] and store.storage["format"] == "fp32"
    recs = records(tokset)
    assert sorted(store.ids) == sorted(r["id"] for r in recs)
    model = load(target)
    for rec in recs[:3]:
        s = store.get(rec["id"])
        assert s.input_ids.tolist() == rec["input_ids"] and s.loss_mask.tolist() == [bool(m) for m in rec["loss_mask"]]
        pre = reference(model, rec["input_ids"], pre_norm_last=True)
        for j, i in enumerate(aux_ids):  # id i = hidden_states[i] = the input of layer i
            assert torch.allclose(s.aux[:, j], pre.hidden_states[i][0], atol=1e-4, rtol=1e-4), (arch, i)
        assert torch.allclose(s.last, pre.hidden_states[N][0], atol=1e-4, rtol=1e-4)
        # ... and with transformers' default, hidden_states[N] is norm(our last): prove the convention.
        post = reference(model, rec["input_ids"], pre_norm_last=False)
        assert not torch.allclose(s.last, post.hidden_states[N][0], atol=1e-2)
        assert torch.allclose(model.model.norm(s.last), post.hidden_states[N][0], atol=1e-4, rtol=1e-4)

    m = read_manifest(out, hs.STAGE)
    assert m["hidden_size"] == {"llama": 128, "deepseek_v3": 64}[arch] and m["last_layer_id"] == N
    assert m["target"]["model_type"] == arch and m["target"]["num_hidden_layers"] == N
    assert m["tokenizer"]["fingerprint"] == read_manifest(tokset)["tokenizer"]["fingerprint"]
    assert m["inputs"]["training_set"]["sha256"] == extract.InputSet.open(tokset).sha256
    assert m["counts"]["samples"] == len(recs) and m["counts"]["tokens"] == sum(len(r["input_ids"]) for r in recs)
    assert m["counts"]["bytes"] == sum(p.stat().st_size for p in out.glob("shard-*.safetensors"))
    assert m["counts"]["shards"] > 1


def test_compact_storages_against_the_reference(tmp_path, tokset, llama_target_dir):
    rec = records(tokset)[0]
    model = load(llama_target_dir)
    pre = reference(model, rec["input_ids"], pre_norm_last=True)
    ref_aux = torch.stack([pre.hidden_states[i][0] for i in (2, 4, 5)], dim=1)
    ref_last = pre.hidden_states[8][0]
    with torch.inference_mode():
        ref_lp = torch.log_softmax(model(torch.tensor([rec["input_ids"]])).logits[0].float(), -1)
    sizes = {}
    for storage in ("bf16", "fp8", "fp8-topk"):
        out = tmp_path / storage
        topk = ["--topk", "8"] if storage == "fp8-topk" else []  # refused beside another storage
        assert run02(tokset, llama_target_dir, out, "--storage", storage, *topk, "--dtype", "float32") == 0
        store = hs.HiddenStates(out)
        s = store.get(rec["id"])
        tokens = store.manifest["counts"]["tokens"]
        sizes[storage] = store.manifest["counts"]["bytes"] / tokens
        if storage == "bf16":
            assert torch.allclose(s.aux, ref_aux, rtol=2 ** -8, atol=1e-3)
            assert torch.allclose(s.last, ref_last, rtol=2 ** -8, atol=1e-3)
        else:
            amax = ref_aux.abs().amax(-1, keepdim=True)
            assert ((s.aux - ref_aux).abs() <= ref_aux.abs() * 2 ** -4 + amax * 2 ** -8).all()
        if storage == "fp8":
            amax = ref_last.abs().amax(-1, keepdim=True)
            assert ((s.last - ref_last).abs() <= ref_last.abs() * 2 ** -4 + amax * 2 ** -8).all()
        if storage == "fp8-topk":
            assert s.last is None
            v, i = ref_lp.topk(8, dim=-1)
            assert torch.equal(s.topk_ids, i)  # row t: the target's top-8 for token t+1
            assert torch.allclose(s.topk_logprobs, v, atol=1e-2, rtol=1e-3)
        # the files hold what bytes_per_token promises (headers are per shard, small)
        bpt = store.manifest["storage"]["bytes_per_token"]
        assert bpt <= sizes[storage] < bpt + 4096 / tokens * store.manifest["counts"]["shards"]
    assert sizes["fp8-topk"] < sizes["fp8"] < sizes["bf16"]


def _committed(out):
    return len(hs.committed_shards(out)) if out.exists() else 0


def _kill_mid_run(inp, model, out, extra, delay_s: float = 0.0) -> int:
    """Start the stage in a subprocess, SIGKILL it once it has committed a shard (+ delay)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, str(SCRIPT), "--input", str(inp), "--model", str(model), "--output", str(out), *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        deadline = time.monotonic() + 300
        while _committed(out) < 1 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(delay_s)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    return _committed(out)


def _shard_bytes(out):
    return {p.name: p.read_bytes() for p in sorted(out.glob("shard-*.safetensors"))}


@pytest.fixture(scope="module")
def kill_case(tmp_path_factory, k25_tokenizer_dir, llama_target_dir):
    base = tmp_path_factory.mktemp("kill")
    inp = make_training_set(base / "tokenized", k25_tokenizer_dir, n=30, seed=5)
    extra = ["--shard-mb", "0.12", "--batch-tokens", "256", "--storage", "fp8", "--device", "cpu"]
    clean = base / "clean"
    assert run02(inp, llama_target_dir, clean, *extra) == 0
    return inp, extra, _shard_bytes(clean), base


def _kill_trial(kill_case, llama_target_dir, name, delay_s):
    inp, extra, clean, base = kill_case
    out = base / name
    done = _kill_mid_run(inp, llama_target_dir, out, extra, delay_s)
    assert not (out / "manifest.json").exists(), "the run finished before the kill; the test proves nothing"
    assert 1 <= done <= len(clean)  # all shards in, manifest not yet: a moment too
    assert run02(inp, llama_target_dir, out, *extra) == 0  # rerun = resume
    assert _shard_bytes(out) == clean  # byte-identical shards, whatever the kill interrupted
    assert not list(out.glob(".tmp-*"))
    assert hs.HiddenStates(out).ids and stage.main(
        ["--input", str(inp), "--model", str(llama_target_dir), "--output", str(out), *extra, "--validate"]) == 0


def test_kill9_mid_run_then_rerun_gives_the_same_shards(kill_case, llama_target_dir):
    _kill_trial(kill_case, llama_target_dir, "killed", 0.0)


# The many-moments sweep for 02 is tests/test_reliability_crash.py::test_kill9_sweep[02]: its kill
# moments follow the run's own output (bytes written), not a wall-clock delay a fast machine outruns.


def test_validate_catches_truncated_and_nan_shards_and_repair_redoes_them(tmp_path, kill_case, llama_target_dir):
    inp, extra, clean, base = kill_case
    out = tmp_path / "hs"
    shutil.copytree(base / "clean", out)
    args = ["--input", str(inp), "--model", str(llama_target_dir), "--output", str(out), *extra]
    assert stage.main([*args, "--validate"]) == 0
    names = sorted(clean)
    # a truncated shard
    p = out / names[1]
    p.write_bytes(p.read_bytes()[:-1000])
    with pytest.raises(PipelineError, match=rf"1 of {len(names)} shards .* {names[1]}: size .*truncated"):
        stage.main([*args, "--validate"])
    # a NaN written in place (same size, valid header)
    p2 = out / names[2]
    meta = safe_open(str(p2), "pt").metadata()
    t = load_file(str(p2))
    t["aux_scale"][3, 1] = float("nan")
    save_file(t, str(p2), metadata=meta)
    with pytest.raises(PipelineError, match=r"2 of .* failed validation"):
        stage.main([*args, "--validate"])
    # --repair moves both aside, redoes them, and the store is whole (and identical) again
    assert stage.main([*args, "--repair"]) == 0
    assert stage.main([*args, "--validate"]) == 0
    assert _shard_bytes(out) == clean
    assert len(list(out.glob("bad-*"))) == 2


def test_disk_estimate_refuses_with_the_figure_unless_forced(tmp_path, tokset, llama_target_dir, monkeypatch):
    free = 50_000
    monkeypatch.setattr(extract.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9 - free, free))
    tokens = extract.InputSet.open(tokset).tokens
    need_kb = tokens * 1029 * 1.02 / 1024  # bf16: (3 aux + last) x 128 x 2 B + ids and mask; 2% for headers
    with pytest.raises(PipelineError, match=rf"not enough disk: {tokens} tokens x 1029 bytes/token .* needs about "
                                            rf"{need_kb:.1f} KB but .* has 48.8 KB free.*--force"):
        run02(tokset, llama_target_dir, tmp_path / "hs")
    assert not list((tmp_path / "hs").glob("shard-*"))
    assert run02(tokset, llama_target_dir, tmp_path / "hs", "--force") == 0


def test_tokenizer_mismatch_is_refused_naming_both(tmp_path, thinking_first_tokenizer_dir, llama_target_dir):
    other = make_training_set(tmp_path / "tok", thinking_first_tokenizer_dir, n=2, seed=0)
    with pytest.raises(PipelineError, match=r"tokenizer mismatch: .*\(fingerprint \w+\), but the target's "
                                            r"tokenizer .* has fingerprint \w+"):
        run02(other, llama_target_dir, tmp_path / "hs")


def test_changed_settings_are_refused_and_overwrite_moves_the_old_output_aside(tmp_path, tokset, llama_target_dir):
    out = tmp_path / "hs"
    assert run02(tokset, llama_target_dir, out, "--layers", "1,3,5") == 0
    assert hs.HiddenStates(out).layer_ids == [1, 3, 5, 8]
    # rerunning the same command is a no-op
    before = _shard_bytes(out)
    assert run02(tokset, llama_target_dir, out, "--layers", "1,3,5") == 0 and _shard_bytes(out) == before
    with pytest.raises(PipelineError, match=r"aux_layer_ids=\[1, 3, 5\]; this run has aux_layer_ids=\[2, 4, 5\]"):
        run02(tokset, llama_target_dir, out)
    assert run02(tokset, llama_target_dir, out, "--overwrite") == 0
    assert hs.HiddenStates(out).layer_ids == [2, 4, 5, 8]
    assert len(list(out.glob("replaced-*/plan.json"))) == 1
    with pytest.raises(PipelineError, match="ids must lie in 1..8"):
        run02(tokset, llama_target_dir, tmp_path / "x", "--layers", "2,9")


def test_ranks_split_the_shards_and_together_equal_one_process(tmp_path, tokset, llama_target_dir, monkeypatch):
    extra = ["--shard-mb", "0.1", "--device", "cpu"]
    assert run02(tokset, llama_target_dir, tmp_path / "one", *extra) == 0
    two = tmp_path / "two"
    assert run02(tokset, llama_target_dir, two, *extra, "--rank", "1", "--world-size", "2") == 0
    assert not (two / "manifest.json").exists()  # rank 0's shards are still missing
    ks = sorted(hs.committed_shards(two))
    assert ks and all(k % 2 == 1 for k in ks)
    monkeypatch.setenv("RANK", "0")  # as torchrun sets it
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert run02(tokset, llama_target_dir, two, *extra) == 0
    assert (two / "manifest.json").exists()  # the last rank to finish writes it
    assert _shard_bytes(two) == _shard_bytes(tmp_path / "one")
    assert sorted(hs.HiddenStates(two).ids) == sorted(hs.HiddenStates(tmp_path / "one").ids)


def test_default_layers_follow_vllm_and_are_distinct_for_small_targets(capsys):
    assert extract.default_aux_layers(61) == [2, 30, 58]  # Kimi-K2.5
    assert extract.parse_layers(None, 8) == [2, 4, 5]
    assert capsys.readouterr().out == ""  # vLLM's own default: nothing to say
    for n in range(1, 80):
        ids, vllm = extract.default_aux_layers(n), extract.vllm_default_aux_layers(n)
        assert ids == sorted(set(ids)) and all(1 <= i <= n for i in ids), (n, ids)
        assert len(ids) == min(3, n)
        if len(set(vllm)) == 3 and min(vllm) >= 1:
            assert ids == sorted(vllm), n  # vLLM uses its default when the config names none
    # N = 6 (the tiny DeepSeek): vLLM's (2, 3, 3) repeats a layer; distinct ids, said in one line.
    assert extract.parse_layers(None, 6) == [2, 3, 4]
    out = capsys.readouterr().out
    assert "2,3,3" in out and "using 2,3,4" in out and len(out.splitlines()) == 1


def test_explicit_layers_are_sorted_and_repeats_and_id_0_refused(capsys):
    # vLLM gathers the aux states in ascending layer order: 4,1,3 is what it serves as 1,3,4.
    assert extract.parse_layers("4,1,3", 8) == [1, 3, 4]
    out = capsys.readouterr().out
    assert "sorted to 1,3,4" in out and len(out.splitlines()) == 1
    assert extract.parse_layers("1,3,8", 8) == [1, 3, 8]  # id N: the last layer's output
    for spec, needle in [("2,3,3", "layer 3 listed more than once"), ("0,4", "id 0 is the embedding"),
                         ("2,9", "ids must lie in 1..8"), ("a,b", "comma-separated"), (",", "at least one")]:
        with pytest.raises(PipelineError, match=needle):
            extract.parse_layers(spec, 8)


def test_negative_layer_ids_reach_the_layer_check(tmp_path, tokset, llama_target_dir, capfd):
    """`--layers -1,2,3` looks like an option to argparse ("expected one argument"); the value
    must reach parse_layers and get its one line, writing nothing."""
    from eagle3_train.common.config import join_dash_values
    from eagle3_train.common.errors import run_main

    assert join_dash_values(["--layers", "-1,2", "--model", "m"], ("--layers",)) == ["--layers=-1,2", "--model", "m"]
    before = {p: p.read_bytes() for p in tokset.rglob("*") if p.is_file() and p.name != ".lock"}
    out = tmp_path / "hs"
    capfd.readouterr()
    assert run_main(stage.main, ["--input", str(tokset), "--model", str(llama_target_dir), "--output", str(out),
                                 "--layers", "-1,2,3", "--device", "cpu"]) == 2
    err = [ln for ln in capfd.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith("error: --layers '-1,2,3': ids must lie in 1..8"), err
    assert {p: p.read_bytes() for p in tokset.rglob("*") if p.is_file() and p.name != ".lock"} == before
    assert not (out / "manifest.json").exists() and not list(out.glob("shard-*"))


def test_token_batches_respect_the_budget():
    recs = [{"input_ids": [0] * n} for n in (50, 40, 40, 30, 10, 10)]
    batches = list(extract_hf.token_batches(recs, batch_tokens=100, max_batch_size=8))
    assert [len(b) for b in batches] == [2, 2, 2]
    assert all(len(b) * max(len(r["input_ids"]) for r in b) <= 100 for b in batches)
    assert [len(b) for b in extract_hf.token_batches(recs, 10**6, 4)] == [4, 2]


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "deepseek_v3"])
def test_gpu_extraction_equals_the_plain_forward(tmp_path, tokset, arch, llama_target_dir, deepseek_target_dir):
    """GPU twin of test_stored_states_equal_the_plain_forward (fp32 on CUDA, reference on CUDA)."""
    from transformers import AutoModelForCausalLM

    target = {"llama": llama_target_dir, "deepseek_v3": deepseek_target_dir}[arch]
    out = tmp_path / "hs"
    assert run02(tokset, target, out, "--storage", "fp32", "--dtype", "float32", "--device", "cuda",
                 "--batch-tokens", "300") == 0
    store = hs.HiddenStates(out)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).to("cuda").eval()
    model.config.tie_last_hidden_states = False
    for rec in records(tokset)[:3]:
        s = store.get(rec["id"])
        with torch.inference_mode():
            ref = model(torch.tensor([rec["input_ids"]], device="cuda"), output_hidden_states=True).hidden_states
        for j, i in enumerate(store.layer_ids[:-1]):
            assert torch.allclose(s.aux[:, j], ref[i][0].cpu(), atol=1e-3, rtol=1e-3)
        assert torch.allclose(s.last, ref[store.layer_ids[-1]][0].cpu(), atol=1e-3, rtol=1e-3)


@pytest.mark.slow
def test_torchrun_two_processes_equal_one(tmp_path, tokset, llama_target_dir):
    """Two real ranks at once (torchrun, CPU): separate index files and locks, one manifest."""
    extra = ["--shard-mb", "0.1", "--device", "cpu"]
    assert run02(tokset, llama_target_dir, tmp_path / "one", *extra) == 0
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--standalone", "--nproc-per-node", "2", str(SCRIPT), "--input", str(tokset),
           "--model", str(llama_target_dir), "--output", str(tmp_path / "two"), *extra]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-2000:]
    assert (tmp_path / "two" / "manifest.json").exists()
    assert sorted(p.name for p in (tmp_path / "two").glob("index*.jsonl")) == ["index.rank-000.jsonl",
                                                                              "index.rank-001.jsonl"]
    assert _shard_bytes(tmp_path / "two") == _shard_bytes(tmp_path / "one")


@pytest.mark.parametrize("where", ["top", "text_config"])
def test_hf_backend_refuses_an_int4_checkpoint_naming_the_vllm_backend(tmp_path, tokset, llama_target_dir, where,
                                                                       capfd):
    """Kimi-K2.5's INT4 experts (compressed-tensors) only run in vLLM: --backend hf says so in one
    line before loading anything, and writes nothing; --backend vllm is not refused for it."""
    from eagle3_train.common.errors import run_main

    model = tmp_path / "int4"
    shutil.copytree(llama_target_dir, model)
    cfg = json.loads((model / "config.json").read_text())
    quant = {"quant_method": "compressed-tensors", "format": "pack-quantized"}
    cfg = {**cfg, "quantization_config": quant} if where == "top" else \
        {"model_type": "llama", "text_config": {**cfg, "quantization_config": quant}}
    from eagle3_train.common.target_layout import check_hf_loadable, quantization

    (model / "config.json").write_text(json.dumps(cfg))
    assert quantization(model) == "compressed-tensors" and quantization(llama_target_dir) is None
    check_hf_loadable(llama_target_dir)  # plain weights pass
    if where == "top":
        out = tmp_path / "out"
        assert run_main(stage.main, ["--input", str(tokset), "--model", str(model), "--output", str(out)]) == 2
        err = capfd.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--backend hf cannot load" in err[0] and "use --backend vllm" in err[0], err
        assert not list(out.glob("shard-*"))
    else:
        with pytest.raises(PipelineError, match="use --backend vllm"):
            check_hf_loadable(model)
