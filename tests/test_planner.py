"""00_plan's figures against what the tiny runs actually write: 02's store on disk, 04's checkpoint
(trainable weights + AdamW states) and export, and 04's memory. Memory is compared as the bytes
04's tensors hold in one step (eagle3_testkit.train_memory: weights, gradients + AdamW states,
the target head, what autograd saves for the backward), not the process's RSS, where the draft's
few MB vanish beside torch and speculators."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from eagle3_testkit import train_memory as memory
from eagle3_train.common.manifest import read_manifest
from eagle3_train.plan import planner
from eagle3_train.train import budget as B
from eagle3_train.train import run
from helpers import inputs_argv, make_training_set, stage_cli
from helpers_train import train_inputs

TOLERANCE = 0.25


def within(planned: int, actual: int) -> bool:
    return abs(planned - actual) <= TOLERANCE * actual


def dir_bytes(d: Path, pattern: str = "**/*") -> int:
    return sum(p.stat().st_size for p in Path(d).glob(pattern) if p.is_file())


def shape_of(target_dir: Path) -> planner.Shape:
    return planner.Shape.from_config(json.loads((Path(target_dir) / "config.json").read_text()))


@pytest.mark.parametrize("storage", ["bf16", "fp8-topk"])
def test_02_store_bytes_match_the_plan(tmp_path, k25_tokenizer_dir, llama_target_dir, storage):
    data = make_training_set(tmp_path / "tok", k25_tokenizer_dir, n=24, seed=5)
    out = tmp_path / "store"
    stage_cli("02_extract_hidden_states").main(
        ["--input", str(data), "--model", str(llama_target_dir), "--output", str(out), "--storage", storage,
         "--topk", "8", "--shard-mb", "0.5"])
    counts = read_manifest(data)["counts"]
    flags = planner.Flags(samples=counts["samples"], tokens_per_sample=counts["tokens"] / counts["samples"],
                          storage=storage, topk=8, shard_mb=0.5, n_aux=3)
    planned, actual = planner.store_bytes(flags, shape_of(llama_target_dir)), dir_bytes(out)
    print(f"02 {storage}: planned {planned} actual {actual} ratio {planned / actual:.3f}")
    assert within(planned, actual), (planned, actual)
    assert planner.tokenized_jsonl_bytes(flags, 500) > 0


@pytest.fixture(scope="module")
def trained(tmp_path_factory, llama_target_dir):
    root = tmp_path_factory.mktemp("plan04")
    inputs = train_inputs(root, llama_target_dir, n=16, shard_size=8, draft_vocab_size=96)
    out = root / "run"
    run(stage_cli("04_train").parse_args(inputs_argv(inputs, out, "--max-steps", "3")))
    return inputs, out


@pytest.mark.parametrize("train_lm_head", [False, True])
def test_04_checkpoint_and_export_match_the_plan(tmp_path, trained, llama_target_dir, train_lm_head):
    inputs, out = trained
    if train_lm_head:  # a second run: the trainable set, hence the checkpoint, grows by lm_head
        out = tmp_path / "run"
        run(stage_cli("04_train").parse_args(inputs_argv(inputs, out, "--max-steps", "3", "--train-lm-head")))
    flags = planner.Flags(samples=16, tokens_per_sample=100, draft_vocab_size=96, n_aux=3,
                          train_lm_head=train_lm_head)
    shape = shape_of(llama_target_dir)
    ckpt = sorted((out / "checkpoints").iterdir())[-1]
    actual = dir_bytes(ckpt, "weights.pt") + dir_bytes(ckpt, "optimizer.pt")
    assert within(planner.checkpoint_bytes(shape, flags), actual), (planner.checkpoint_bytes(shape, flags), actual)
    exported = dir_bytes(out / "export", "*.safetensors")
    planned = planner.export_bytes(shape, flags, 2)  # 04 exports in bf16 by default (--export-dtype)
    print(f"04 lm_head={train_lm_head}: checkpoint planned {planner.checkpoint_bytes(shape, flags)} actual {actual}; "
          f"export planned {planned} actual {exported}")
    assert within(planned, exported), (planned, exported)


@pytest.mark.parametrize("extra", [(), ("--max-tokens-per-batch", "512", "--ttt-steps", "5", "--train-lm-head")])
def test_04_memory_matches_the_plan(tmp_path, trained, extra):
    inputs, _ = trained
    rows, flags = memory.compare(stage_cli("04_train").parse_args(inputs_argv(inputs, tmp_path / "r", *extra)))
    print({k: round(r["ratio"], 3) for k, r in rows.items()})
    assert rows["activations"]["measured"] > rows["weights"]["measured"]  # the batch, not the draft, dominates
    for part in ("weights", "grads_and_adam", "activations", "total"):
        assert within(rows[part]["planned"], rows[part]["measured"]), (part, rows[part], flags)


@pytest.fixture(scope="module")
def mla_inputs(tmp_path_factory, deepseek_target_dir):
    return train_inputs(tmp_path_factory.mktemp("plan04mla"), deepseek_target_dir, n=16, shard_size=8,
                        draft_vocab_size=96)


@pytest.mark.parametrize("extra", [(), ("--max-tokens-per-batch", "512", "--ttt-steps", "5")])
def test_04_memory_of_the_mla_draft_matches_the_plan(tmp_path, mla_inputs, extra):
    """The MLA layer keeps more per TTT step than the Llama one (each step expands the whole latent
    cache again through kv_b, and dense attention keeps scores over it): the plan follows."""
    rows, flags = memory.compare(stage_cli("04_train").parse_args(
        inputs_argv(mla_inputs, tmp_path / "r", "--draft-arch", "mla", *extra)))
    print({k: round(r["ratio"], 3) for k, r in rows.items()})
    assert flags.draft_arch == "mla" and planner.is_mla(shape_of(mla_inputs["target"]), flags)
    for part in ("weights", "grads_and_adam", "activations", "total"):
        assert within(rows[part]["planned"], rows[part]["measured"]), (part, rows[part], flags)


@pytest.mark.parametrize("extra", [(), ("--block-size", "4"),
                                   ("--max-tokens-per-batch", "512", "--block-size", "8", "--block-anchors", "64")])
def test_04_memory_of_the_dflash_draft_matches_the_plan(tmp_path, mla_inputs, extra):
    """The DFlash block draft on an MLA target (the plan builds it as 04 does); what it keeps grows
    with the blocks' queries (anchors x block) and their dense scores over each sample's context,
    not with TTT steps: the plan follows at block 8 (the default) and 4 and fewer anchors."""
    rows, flags = memory.compare(stage_cli("04_train").parse_args(
        inputs_argv(mla_inputs, tmp_path / "r", "--draft-arch", "dflash", *extra)))
    print({k: round(r["ratio"], 3) for k, r in rows.items() if r["ratio"]})
    assert flags.draft_arch == "dflash" and planner.kind(shape_of(mla_inputs["target"]), flags) == "dflash"
    for part in ("weights", "grads_and_adam", "activations", "total"):
        assert within(rows[part]["planned"], rows[part]["measured"]), (part, rows[part], flags)


def exported_numel(export: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(export / "model.safetensors"), "pt") as f:
        return sum(_numel(f.get_slice(k).get_shape()) for k in f.keys() if k not in ("d2t", "t2d"))


def test_mla_draft_parameters_are_counted_exactly(tmp_path, mla_inputs):
    out = tmp_path / "run"
    run(stage_cli("04_train").parse_args(inputs_argv(mla_inputs, out, "--max-steps", "1", "--draft-arch", "mla")))
    flags = planner.Flags(samples=16, tokens_per_sample=100, draft_vocab_size=96, n_aux=3, draft_arch="mla")
    assert sum(planner.draft_params(shape_of(mla_inputs["target"]), flags).values()) == exported_numel(out / "export")


def test_dflash_draft_parameters_and_export_are_counted_exactly(tmp_path, mla_inputs):
    """The DFlash export holds every draft weight but the frozen embeddings (vLLM shares the
    target's), and the mask embedding beside them: both counted as 00_plan counts them."""
    import torch

    out = tmp_path / "run"
    run(stage_cli("04_train").parse_args(inputs_argv(mla_inputs, out, "--max-steps", "1", "--draft-arch", "dflash")))
    assert json.loads((out / "export" / "config.json").read_text())["speculators_model_type"] == "dflash"
    shape, flags = shape_of(mla_inputs["target"]), planner.Flags(samples=16, tokens_per_sample=100,
                                                                 draft_vocab_size=96, n_aux=3, draft_arch="dflash")
    p = planner.draft_params(shape, flags)
    mask = torch.load(out / "export" / "mask_embedding.pt", weights_only=True)["embedding"].numel()
    assert sum(p.values()) - p["embed"] == exported_numel(out / "export") + mask
    assert mask == shape.hidden


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def test_the_plan_builds_the_draft_04_builds_for_kimi(tmp_path):
    """auto is the MLA layer for Kimi-K2.5, dflash the block draft (block 8, or --num-speculative-tokens
    + 1 if larger, as 04);
    the MLA layer is smaller than a Llama layer at its width; mla on a target without MLA is refused
    in one line, as 04 refuses it."""
    cfg = json.loads((Path(__file__).parents[1] / "docs" / "kimi-k2.5-text-config.json").read_text())
    kimi = planner.Shape.from_config(cfg)
    flags = dict(samples=100000, tokens_per_sample=10000)
    auto, mla, llama = (planner.Flags(**flags), planner.Flags(**flags, draft_arch="mla"),
                        planner.Flags(**flags, draft_arch="llama"))
    assert kimi.mla and planner.kind(kimi, auto) == "mla" and planner.is_mla(kimi, mla)
    assert not planner.is_mla(kimi, llama)
    assert 500e6 < planner.layer_params(kimi, mla) < planner.layer_params(kimi, llama)
    p = planner.plan(kimi, mla)["stages"]["04"]
    assert p["draft"] == "mla" and p["epochs"] == 1 and p["steps"] == 30518  # 1e9 tokens / (4096 x 8 GPUs)
    for asked, block in (({}, 8), ({"num_speculative_tokens": 3}, 8), ({"num_speculative_tokens": 11}, 12),
                         ({"block_size": 4}, 4)):
        d = planner.plan(kimi, planner.Flags(**flags, draft_arch="dflash", **asked))["stages"]["04"]
        assert d["draft"] == "dflash" and d["block_size"] == block and d["fits"], d
    # the block's queries (512 anchors x 8) and their dense scores make block 8 the larger
    d4, d8 = (planner.train_memory(kimi, planner.Flags(**flags, draft_arch="dflash", block_size=b))["activations"]
              for b in (4, 8))
    assert d8 > 1.5 * d4
    small = planner.plan(kimi, planner.Flags(samples=2000, tokens_per_sample=240, gpus=1))["stages"]["04"]
    assert small["epochs"] == 9 and small["steps"] >= 1000  # 04's rule: the fewest epochs to 1,000 steps
    from eagle3_train.common.errors import PipelineError

    llama_shape = planner.Shape(layers=2, hidden=64, vocab=500, heads=4, kv_heads=2, head_dim=16, intermediate=128)
    with pytest.raises(PipelineError, match="multi-head latent attention"):
        planner.layer_params(llama_shape, planner.Flags(**flags, draft_arch="mla"))


def test_dry_runs_print_the_plan_and_write_nothing(tmp_path, trained, k25_tokenizer_dir, llama_target_dir, capsys):
    data = make_training_set(tmp_path / "tok", k25_tokenizer_dir, n=4, seed=6)
    assert stage_cli("02_extract_hidden_states").main(
        ["--input", str(data), "--model", str(llama_target_dir), "--output", str(tmp_path / "s"), "--dry-run"]) == 0
    inputs, _ = trained
    assert stage_cli("04_train").main(inputs_argv(inputs, tmp_path / "r", "--dry-run", lr=None)) == 0
    out = capsys.readouterr().out
    assert "02 plan:" in out and "04 plan:" in out, out
    hidden = json.loads((Path(inputs["target"]) / "config.json").read_text())["hidden_size"]
    assert f"lr {B.default_lr(hidden):.3g} (default: " in out  # the width rule, as 04 would choose it
    assert not (tmp_path / "s").exists() and not (tmp_path / "r").exists()


def test_plan_script_reads_a_wrapper_config_and_prints_json(tmp_path, capsys):
    cfg = json.loads((Path(__file__).parents[1] / "docs" / "kimi-k2.5-text-config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "kimi_k25", "text_config": cfg}))
    assert stage_cli("00_plan").main(["--target", str(tmp_path / "config.json"), "--samples", "10",
                                        "--tokens-per-sample", "1000", "--json", "--rate-02", "1000"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert p["tokens"] == 10000 and p["stages"]["02"]["rate_source"] == "given"
    assert p["stages"]["02"]["hours"] == round(10000 / 1000 / 3600, 2)
    assert p["stages"]["04"]["draft"] == "mla" and 8e9 < p["stages"]["04"]["export_fp32"] < 10e9
    # DFlash's fp32 export at Kimi size: every draft weight in 4 bytes but the embeddings (163840 x
    # 7168, shared with the target by vLLM); fc 3 x 7168^2 + the layer + lm_head 32000 x 7168
    assert stage_cli("00_plan").main(["--target", str(tmp_path / "config.json"), "--samples", "10",
                                        "--tokens-per-sample", "1000", "--json", "--rate-02", "1000",
                                        "--draft-arch", "dflash"]) == 0
    d = json.loads(capsys.readouterr().out)["stages"]["04"]
    assert d["draft"] == "dflash" and d["block_size"] == 8 and 3.5e9 < d["export_fp32"] < 5e9


@pytest.mark.parametrize("flags,needle", [
    (["--gpus", "0"], "--gpus must be positive, not 0"),
    (["--samples", "-5"], "--samples must be positive, not -5"),
    (["--draft-vocab-size", "-1"], "--draft-vocab-size must be positive"),
    (["--max-tokens-per-batch", "0"], "--max-tokens-per-batch must be positive"),
    (["--rate-02", "0"], "--rate-02 must be positive"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization must lie in (0, 1], not 1.5"),
    (["--weights-gb", "0"], "--weights-gb must be positive, not 0"),
    (["--gen-servers", "0"], "--gen-servers must be positive, not 0"),
    (["--gen-servers", "9"], "--gen-servers 9 needs at least as many --gpus, not 8"),
    (["--gen-max-tokens", "-1"], "--gen-max-tokens must be positive"),
])
def test_plan_refuses_impossible_settings_in_one_line(flags, needle, capfd):
    from eagle3_train.common.errors import run_main

    target = Path(__file__).parents[1] / "docs" / "kimi-k2.5-text-config.json"
    assert run_main(stage_cli("00_plan").main, ["--target", str(target), *flags]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert err == [f"error: {err[0][len('error: '):]}"] and needle in err[0], err


@pytest.mark.parametrize("content,needle", [
    ('{"stage": "04_train", "outputs": {}}', "not a model's config.json (no hidden_size"),
    ("not json", "not a JSON model config"),
])
def test_plan_refuses_a_target_file_that_is_not_a_model_config(tmp_path, content, needle, capfd):
    from eagle3_train.common.errors import run_main

    (tmp_path / "manifest.json").write_text(content)
    assert run_main(stage_cli("00_plan").main, ["--target", str(tmp_path / "manifest.json")]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err


def test_plan_names_a_missing_target_folder_as_missing(tmp_path, capfd):
    from eagle3_train.common.errors import run_main

    assert run_main(stage_cli("00_plan").main, ["--target", str(tmp_path / "no-such-model")]) == 2
    err = capfd.readouterr().err.strip()
    assert "no such folder or file" in err and "repo" not in err, err


def kimi_shape() -> planner.Shape:
    return planner.Shape.from_config(json.loads(
        (Path(__file__).parents[1] / "docs" / "kimi-k2.5-text-config.json").read_text()))


def test_01b_is_one_server_whose_kv_cache_sets_the_concurrency_for_kimi():
    """The runbook's one TP-8 vLLM over 8 x 96 GB with the INT4 weights (554 GB), by hand: MLA caches
    (kv_lora_rank 512 + rope 64) x 61 layers x 2 B = 70,272 B a token on every rank; per GPU
    96 x 0.9 - 554 / 8 - 2 (reserve) = 15.15 GB of cache = 215,590 tokens; answers of 1,024 prompt +
    16,384 generated tokens: 12 stay resident (not the 256 the runbook used to send)."""
    f = planner.Flags(samples=100000, tokens_per_sample=10000, weights_gb=554)
    s = planner.plan(kimi_shape(), f)["stages"]["01b"]
    assert s["serving"] == {"servers": 1, "gpus_per_server": 8, "kv_bytes_per_token": 70272, "request_tokens": 17408,
                            "weights_per_gpu": 69_250_000_000, "kv_cache_per_gpu": 15_150_000_000,
                            "resident_tokens": 215590, "concurrency": 12, "batch": 12}
    assert 15.15e9 // 70272 == 215590 and 215590 // 17408 == 12
    # 12 answers at 30 tok/s alone, 2,000 at most: 12 / (1/30 + 12/2000) = 305 tok/s; 1e9 tokens in 910 h
    assert round(s["rate_tok_s"], 2) == 305.08 and s["hours"] == round(1e9 / (12 / (1 / 30 + 12 / 2000)) / 3600, 2)
    assert s["rate_source"].startswith("assumed: 1 server x 305 tok/s at 12 answers resident (--concurrency 12)")
    assert s["gpu_memory"] == 71_250_000_000 and s["fits"]
    # 8K answers: twice as many resident; 8 one-GPU servers: the weights do not fit, 01b never ends
    assert planner.serving(kimi_shape(), planner.Flags(**{**f.__dict__, "gen_max_tokens": 8192}))["concurrency"] \
        == 215590 // 9216 == 23
    eight = planner.plan(kimi_shape(), planner.Flags(**{**f.__dict__, "gen_servers": 8}))["stages"]["01b"]
    assert eight["serving"]["concurrency"] == 0 and eight["hours"] is None and not eight["fits"]


def test_01b_without_the_weights_size_assumes_a_batch_and_says_so():
    s = planner.plan(kimi_shape(), planner.Flags(samples=10, tokens_per_sample=1000))["stages"]["01b"]
    assert s["serving"]["batch"] == planner.GEN_BATCH == 64 and "concurrency" not in s["serving"]
    assert round(s["rate_tok_s"]) == round(64 / (1 / 30 + 64 / 2000)) == 980 and "gpu_memory" not in s
    assert "KV cache unknown: pass --weights-gb" in s["rate_source"]


def test_gqa_kv_cache_is_split_over_the_servers_ranks():
    llama = planner.Shape(layers=2, hidden=64, vocab=500, heads=4, kv_heads=2, head_dim=16, intermediate=128)
    # K and V x 2 heads x 16 x 2 layers x 2 B on one GPU; at TP 8 each rank still holds one of the 2 heads
    assert planner.kv_bytes_per_token(llama, planner.Flags(samples=1, tokens_per_sample=1, gpus=1)) == 256
    assert planner.kv_bytes_per_token(llama, planner.Flags(samples=1, tokens_per_sample=1)) == 128


def test_plan_prints_01b_s_recommended_concurrency(capsys):
    target = Path(__file__).parents[1] / "docs" / "kimi-k2.5-text-config.json"
    assert stage_cli("00_plan").main(["--target", str(target), "--weights-gb", "554"]) == 0
    out = capsys.readouterr().out
    row = next(x for x in out.splitlines() if x.startswith("01b "))
    assert "71.2 GB" in row and "305" in row and "(--concurrency 12)" in row, row
    assert "KV cache 15.2 GB = 215,590 tokens" in out
    assert "01b recommended: --concurrency 12 (12 per server: vllm serve --max-num-seqs 12)" in out


def test_plan_reads_the_weights_of_a_model_folder(llama_target_dir, capsys):
    from eagle3_train.common.vllm_server import weights_gb

    assert stage_cli("00_plan").main(["--target", str(llama_target_dir), "--gpus", "1", "--json"]) == 0
    serve = json.loads(capsys.readouterr().out)["stages"]["01b"]["serving"]
    assert serve["weights_per_gpu"] == int(weights_gb(llama_target_dir) * planner.GB) > 0


def test_the_capture_path_for_kimi_by_hand():
    """01b --capture-hidden-states on the same TP-8 server (issue 26), by hand: the hidden-state cache
    holds 3 aux + the last layer x 7,168 x 2 B = 57,344 B a token beside the 70,272 B of MLA cache (one
    cache group: the same blocks), so 15.15 GB per GPU hold 15.15e9 // 127,616 = 118,715 tokens = 6
    answers of 17,408 (plain: 12); each step runs 2 tokens an answer: 6 / (1/30 + 2 x 6/2000) = 152.54
    tok/s, 1e9 tokens in 1,821.0 h, against 910.49 h of plain 01b + 87.77 h of 02 = 998.26 h. The
    store and answers are the same bytes; 6 answers' per-request files are in flight (6 x 17,408 x 57,344 B)."""
    f = planner.Flags(samples=100000, tokens_per_sample=10000, weights_gb=554)
    p = planner.plan(kimi_shape(), f)
    c = p["capture"]
    assert c["01b"]["serving"] == {"servers": 1, "gpus_per_server": 8, "kv_bytes_per_token": 70272,
                                   "hidden_bytes_per_token": 57344, "tokens_per_step": 2, "request_tokens": 17408,
                                   "weights_per_gpu": 69_250_000_000, "kv_cache_per_gpu": 15_150_000_000,
                                   "resident_tokens": 118715, "concurrency": 6, "batch": 6}
    assert round(c["01b"]["rate_tok_s"], 2) == 152.54 and c["01b"]["hours"] == 1820.99 and c["01b"]["fits"]
    assert c["two_pass"]["hours"] == round(910.49 + 87.77, 2) == 998.26
    assert c["cheaper"] == "two_pass" and c["saves_hours"] == round(1820.99 - 998.26, 2)
    assert c["01b"]["scratch_disk"] == 6 * 17408 * 57344 and c["saves_disk"] == c["01b"]["scratch_disk"]
    assert c["01b"]["disk"] == c["two_pass"]["disk"] == p["stages"]["01b"]["disk"] + p["stages"]["02"]["disk"]
    assert p["stages"]["01b"]["serving"]["concurrency"] == 12  # the plain path is unchanged
    # a measured plain rate carries over at the model's ratio; a cheap enough 01b makes capture win:
    # with no KV limit assumed (no --weights-gb) 64 vs 64 x 70,272 // 127,616 = 35 answers
    given = planner.plan(kimi_shape(), planner.Flags(**{**f.__dict__, "rates": {"01b": 1000.0}}))["capture"]["01b"]
    assert round(given["rate_tok_s"], 2) == round(1000 * 152.54237 / 305.08475, 2) == 500.0
    assert planner.serving(kimi_shape(), planner.Flags(samples=1, tokens_per_sample=1), capture=True)["batch"] == 35
    quick = planner.plan(kimi_shape(), planner.Flags(**{**f.__dict__, "rates": {"02": 100.0}}))["capture"]
    assert quick["cheaper"] == "capture" and quick["two_pass"]["hours"] == round(910.49 + 1e9 / 100 / 3600, 2)


def test_plan_prints_both_paths_and_the_cheaper(capsys):
    target = Path(__file__).parents[1] / "docs" / "kimi-k2.5-text-config.json"
    assert stage_cli("00_plan").main(["--target", str(target), "--weights-gb", "554"]) == 0
    out = capsys.readouterr().out
    assert ("01b --capture-hidden-states (no 02): KV 70,272 + hidden states 57,344 B a token (4 layers x 7,168 "
            "x 2 B) = 118,715 tokens per GPU: --concurrency 6 (vllm serve --max-num-seqs 6); 2 tokens a step: "
            "153 tok/s, 1,821.0 h") in out
    assert "two-pass 01b + 02 = 910.5 h + 87.8 h = 998.3 h" in out
    assert "cheaper: two-pass (01b, then 02), by 822.7 h (the other takes 1.82x as long); disk 6.0 GB less" in out
    assert stage_cli("00_plan").main(["--target", str(target), "--weights-gb", "554", "--gen-servers", "8"]) == 0
    assert "cheaper: neither path finishes" in capsys.readouterr().out
