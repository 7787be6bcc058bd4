"""00_plan's figures against what the tiny runs actually write: 02's store on disk, 04's checkpoint
(trainable weights + AdamW states) and export, and 04's memory. Memory is compared as the bytes
04's tensors hold in one step (eagle3_testkit.train_memory: weights, gradients + AdamW states,
the target head, what autograd saves for the backward), not the process's RSS, where the draft's
few MB vanish beside torch and speculators."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from eagle3_testkit import train_memory as memory
from eagle3_train.common.manifest import read_manifest
from eagle3_train.plan import gen, planner, stage
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
         *(["--topk", "8"] if storage == "fp8-topk" else []), "--shard-mb", "0.5"])
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
                                   ("--max-tokens-per-batch", "512", "--block-size", "8", "--block-anchors", "0.1"),
                                   ("--block-size", "4", "--draft-layers", "2")])
def test_04_memory_of_the_dflash_draft_matches_the_plan(tmp_path, mla_inputs, extra):
    """The DFlash block draft on an MLA target (the plan builds it as 04 does); what it keeps grows
    with the blocks' queries (anchors x block) and their dense scores over each sample's context,
    not with TTT steps: the plan follows at block 8 (the default) and 4 and fewer anchors (a tenth of
    each sequence's supervised positions), and with two draft layers."""
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
                                        "--tokens-per-sample", "1000", "--gen-prompt-tokens", "100", "--json",
                                        "--rate-02", "1000"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert p["tokens"] == 10000 and p["stages"]["02"]["rate_source"] == "given"
    assert p["stages"]["02"]["hours"] == round(10000 / 1000 / 3600, 2)
    assert p["stages"]["04"]["draft"] == "mla" and 8e9 < p["stages"]["04"]["export_fp32"] < 10e9
    # DFlash's fp32 export at Kimi size: every draft weight in 4 bytes but the embeddings (163840 x
    # 7168, shared with the target by vLLM); fc 3 x 7168^2 + the layer + lm_head 32000 x 7168
    assert stage_cli("00_plan").main(["--target", str(tmp_path / "config.json"), "--samples", "10",
                                        "--tokens-per-sample", "1000", "--gen-prompt-tokens", "100", "--json",
                                        "--rate-02", "1000", "--draft-arch", "dflash"]) == 0
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
    (["--tokens-per-sample", "900"], "--tokens-per-sample 900 must exceed --gen-prompt-tokens 1024"),
    (["--decode-context-parallel-size", "3"], "--decode-context-parallel-size 3 must divide a server's 8 GPUs"),
    (["--decode-context-parallel-size", "0"], "--decode-context-parallel-size 0 must divide"),
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
    96 x 0.9 - 554 / 8 - 2 (reserve) = 15.15 GB of cache = 215,590 tokens. Answers of 10,000 - 1,024
    = 8,976 tokens on average (the assumed lognormal cut at 16,384): one in flight holds 1,024 +
    E[a^2]/2E[a] = 7,163 tokens on average, so auto fills the cache at 30 (worst case, 1,024 + 16,384
    each: 12; every answer at its mean to the end: 21)."""
    f = planner.Flags(samples=100000, tokens_per_sample=10000, weights_gb=554)
    s = planner.plan(kimi_shape(), f)["stages"]["01b"]
    a = s["answers"]
    assert a["mean"] == 8976 and a["max"] == 16384 and a["source"].startswith("assumed: reasoning answers")
    assert s["serving"] == {"servers": 1, "gpus_per_server": 8, "kv_bytes_per_token": 70272, "kv_cache_dtype": "auto",
                            "dcp": 1, "request_tokens": 17408, "typical_tokens": round(1024 + a["resident"]),
                            "weights_per_gpu": 69_250_000_000, "kv_cache_per_gpu": 15_150_000_000,
                            "gpu_tokens": 215590, "resident_tokens": 215590, "worst_case": 12, "mean_level": 21,
                            "fill_level": 30, "concurrency": 30, "batch": 30}
    assert 15.15e9 // 70272 == 215590 and 215590 // 17408 == 12 and int(215590 // (1024 + a["resident"])) == 30
    # tok/s at 30: between the box's 98 at 1 and 1,130 at 32 (log-log), x the context's share (7,163 tokens)
    at30 = 98 * 30 ** (math.log(1130 / 98) / math.log(32)) * (1 - 0.25 * (7163 - 2048) / 14336)
    assert round(s["rate_tok_s"], 6) == round(at30, 6) and 983 < at30 < 984
    assert s["tokens"] == 100000 * 8976 and s["hours"] == round(100000 * 8976 / at30 / 3600, 2)
    assert s["rate_source"].startswith("1 server x 983 tok/s at 30 answers in flight (--concurrency auto); assumed: ")
    assert s["gpu_memory"] == 71_250_000_000 and s["fits"]
    # 8K answers at most: more resident; 8 one-GPU servers: the weights do not fit, 01b never ends
    short = planner.serving(kimi_shape(), planner.Flags(**{**f.__dict__, "gen_max_tokens": 8192}))
    assert short["worst_case"] == 215590 // 9216 == 23 and short["concurrency"] > 30
    eight = planner.plan(kimi_shape(), planner.Flags(**{**f.__dict__, "gen_servers": 8}))["stages"]["01b"]
    assert eight["serving"]["concurrency"] == 0 and eight["hours"] is None and not eight["fits"]


def test_01b_without_the_weights_size_assumes_a_batch_and_says_so():
    s = planner.plan(kimi_shape(), planner.Flags(samples=10, tokens_per_sample=1000, gen_prompt_tokens=100))
    s = s["stages"]["01b"]
    assert s["serving"]["batch"] == planner.GEN_BATCH == 64 and "concurrency" not in s["serving"]
    # 64 answers: between 1,130 at 32 and 2,250 at 128 (log-log); a short context (< 2,048): the curve's own
    assert round(s["rate_tok_s"], 6) == round(1130 * 2 ** (math.log(2250 / 1130) / math.log(4)), 6)
    assert "gpu_memory" not in s and "KV cache unknown: pass --weights-gb" in s["rate_source"]


def test_gqa_kv_cache_is_split_over_the_servers_ranks():
    llama = planner.Shape(layers=2, hidden=64, vocab=500, heads=4, kv_heads=2, head_dim=16, intermediate=128)
    # K and V x 2 heads x 16 x 2 layers x 2 B on one GPU; at TP 8 each rank still holds one of the 2 heads
    assert planner.kv_bytes_per_token(llama, planner.Flags(samples=1, tokens_per_sample=1, gpus=1)) == 256
    assert planner.kv_bytes_per_token(llama, planner.Flags(samples=1, tokens_per_sample=1)) == 128


def test_plan_prints_01b_s_recommended_concurrency(capsys):
    target = Path(__file__).parents[1] / "docs" / "kimi-k2.5-text-config.json"
    assert stage_cli("00_plan").main(["--target", str(target), "--weights-gb", "554", "--gpu-memory-gb", "96"]) == 0
    out = capsys.readouterr().out
    row = next(x for x in out.splitlines() if x.startswith("01b "))
    assert "71.2 GB" in row and "983" in row and "(--concurrency auto)" in row, row
    assert "KV cache 15.2 GB = 215,590 tokens" in out
    assert ("01b answers: mean 8,976, p50 7,948, p90 16,384, p99 16,384, max 16,384 tokens (assumed: reasoning "
            "answers, lognormal (sigma 1.0) of mean 8,976 cut at --gen-max-tokens 16,384); one in flight holds "
            "7,163 tokens on average (1,024 prompt + E[a^2]/2E[a] 6,139)") in out
    assert ("01b --concurrency auto should reach ~30 (30 a server: the cache filled by answers' typical residency; "
            "worst case 12, every answer 1,024 + 16,384 tokens; mean-based 21): 983 tok/s, 253.5 h") in out
    assert ("01b fixed --concurrency: 12: 515 tok/s, 483.9 h; 32: 983 tok/s, 253.5 h (over the cache: preempts); "
            "64: 983 tok/s, 253.5 h (over the cache: preempts); 128: ") in out
    assert "01b other caches: --kv-cache-dtype fp8: 431,181 tokens, auto ~60, " in out
    assert "01b cost: --kv-cache-dtype fp8 changes the target's numerics" in out
    assert "01b cost: --decode-context-parallel-size does not combine with speculative decoding on TRITON_MLA" in out


def test_plan_reads_the_weights_of_a_model_folder(llama_target_dir, capsys):
    from eagle3_train.common.vllm_server import weights_gb

    assert stage_cli("00_plan").main(["--target", str(llama_target_dir), "--gpus", "1", "--json"]) == 0
    serve = json.loads(capsys.readouterr().out)["stages"]["01b"]["serving"]
    assert serve["weights_per_gpu"] == int(weights_gb(llama_target_dir) * planner.GB) > 0


def test_the_capture_path_for_kimi_by_hand():
    """01b --capture-hidden-states on the same TP-8 server, by hand: the hidden-state cache holds 3 aux +
    the last layer x 7,168 x 2 B = 57,344 B a token beside the 70,272 B of MLA cache (one cache group:
    the same blocks), so 15.15 GB per GPU hold 15.15e9 // 127,616 = 118,715 tokens: auto ~16 answers of
    7,163 tokens typical (worst case 6; plain: 30); each step runs 2 tokens an answer, as a step of 32:
    1,130 x 0.9108 (context) / 2 = 514.6 tok/s, / 1.15 for PIECEWISE graphs = 447.5 tok/s, 897.6M answer
    tokens in 557.2 h, against 253.5 h of plain 01b + 87.8 h of 02 = 341.3 h. The store and answers are the same bytes; 16 answers'
    per-request files are in flight (16 x 17,408 x 57,344 B)."""
    f = planner.Flags(samples=100000, tokens_per_sample=10000, weights_gb=554)
    p = planner.plan(kimi_shape(), f)
    c = p["capture"]
    typical = p["stages"]["01b"]["serving"]["typical_tokens"]
    assert c["01b"]["serving"] == {"servers": 1, "gpus_per_server": 8, "kv_bytes_per_token": 70272,
                                   "kv_cache_dtype": "auto", "dcp": 1, "typical_tokens": typical,
                                   "hidden_bytes_per_token": 57344, "tokens_per_step": 2, "request_tokens": 17408,
                                   "weights_per_gpu": 69_250_000_000, "kv_cache_per_gpu": 15_150_000_000,
                                   "gpu_tokens": 118715, "resident_tokens": 118715, "worst_case": 6,
                                   "mean_level": 11, "fill_level": 16, "concurrency": 16, "batch": 16}
    assert round(c["01b"]["rate_tok_s"] * planner.CAPTURE_PIECEWISE_COST, 1) == 514.6 and c["01b"]["fits"]
    assert round(c["01b"]["hours"], 1) == round(484.52 * planner.CAPTURE_PIECEWISE_COST, 1) == 557.2
    assert c["two_pass"]["hours"] == round(253.54 + 87.77, 2) == 341.31
    assert c["cheaper"] == "two_pass" and c["saves_hours"] == round(c["01b"]["hours"] - 341.31, 2)
    assert c["01b"]["scratch_disk"] == 16 * 17408 * 57344 and c["saves_disk"] == c["01b"]["scratch_disk"]
    assert c["01b"]["disk"] == c["two_pass"]["disk"] == p["stages"]["01b"]["disk"] + p["stages"]["02"]["disk"]
    assert p["stages"]["01b"]["serving"]["concurrency"] == 30  # the plain path is unchanged
    # a given plain rate is a measured point at auto's level: the curve scales to it, capture with it;
    # with no KV limit assumed (no --weights-gb) 64 vs 64 x 70,272 // 127,616 = 35 answers
    plain = p["stages"]["01b"]["rate_tok_s"]
    given = planner.plan(kimi_shape(), planner.Flags(**{**f.__dict__, "rates": {"01b": 1000.0}}))
    assert given["stages"]["01b"]["rate_tok_s"] == 1000.0 and given["stages"]["01b"]["rate_source"] == "given"
    assert round(given["capture"]["01b"]["rate_tok_s"], 6) == round(1000 * c["01b"]["rate_tok_s"] / plain, 6)
    assert planner.serving(kimi_shape(), planner.Flags(samples=1, tokens_per_sample=1), capture=True)["batch"] == 35
    quick = planner.plan(kimi_shape(), planner.Flags(**{**f.__dict__, "rates": {"02": 100.0}}))["capture"]
    assert quick["cheaper"] == "capture" and quick["two_pass"]["hours"] == round(253.54 + 1e9 / 100 / 3600, 2)


def test_plan_prints_both_paths_and_the_cheaper(capsys):
    target = Path(__file__).parents[1] / "docs" / "kimi-k2.5-text-config.json"
    assert stage_cli("00_plan").main(["--target", str(target), "--weights-gb", "554", "--gpu-memory-gb", "96"]) == 0
    out = capsys.readouterr().out
    assert ("01b --capture-hidden-states (no 02): KV 70,272 + hidden states 57,344 B a token (4 layers x 7,168 "
            "x 2 B) = 118,715 tokens a server: --concurrency auto ~16 (worst case 6); 2 tokens a step: "
            "447 tok/s, 557.2 h") in out  # 515 tok/s / 1.15 for the capturing server's PIECEWISE graphs
    assert "two-pass 01b + 02 = 253.5 h + 87.8 h = 341.3 h" in out
    assert "cheaper: two-pass (01b, then 02), by 215.9 h (the other takes 1.63x as long); disk 16.0 GB less" in out
    assert stage_cli("00_plan").main(["--target", str(target), "--weights-gb", "554", "--gpu-memory-gb", "96",
                                        "--gen-servers", "8"]) == 0
    assert "cheaper: neither path finishes" in capsys.readouterr().out
    # a run of a few samples: both paths round to 0 h, and the table still prints
    assert stage_cli("00_plan").main(["--target", str(target), "--weights-gb", "554", "--gpu-memory-gb", "96",
                                        "--samples", "1", "--tokens-per-sample", "1100"]) == 0
    assert "(both under a minute); disk" in capsys.readouterr().out


@pytest.mark.parametrize("gpu0,expected", [(102.6, 102.6), (None, 96.0)])
def test_gpu_memory_defaults_to_gpu_0_else_96_with_a_note(monkeypatch, capfd, gpu0, expected):
    """No --gpu-memory-gb: GPU 0's memory as torch reports it (an RTX PRO 6000's ~102.6 GB), else
    96 with one note on stderr (stdout stays JSON)."""
    from eagle3_train.plan import config as plan_config

    monkeypatch.setattr(plan_config, "gpu0_memory_gb", lambda: gpu0)
    target = Path(__file__).parents[1] / "docs" / "kimi-k2.5-text-config.json"
    assert stage_cli("00_plan").main(["--target", str(target), "--weights-gb", "554", "--json"]) == 0
    out, err = capfd.readouterr()
    kv = json.loads(out)["stages"]["01b"]["serving"]["kv_cache_per_gpu"]
    assert kv == round(expected * 0.9 * 1e9 - 554e9 / 8 - 2e9)
    notes = [line for line in err.splitlines() if line.strip()]
    assert notes == ([] if gpu0 else ["note: no CUDA GPU here: --gpu-memory-gb assumed 96 (pass your GPUs' memory)"])


# ----------------------------------------------------------------------------- 01b's model (plan/gen.py)

KIMI = ["--weights-gb", "554", "--gpu-memory-gb", "96"]


def test_fp8_kv_halves_a_token_and_decode_context_parallel_multiplies_the_cache():
    """--kv-cache-dtype fp8: 576 x 61 x 1 B = 35,136 B a token, 431,181 tokens per GPU (public figures for
    the box: ~190k bf16 / ~480-490k fp8); --decode-context-parallel-size 8: each rank keeps 1/8 of every
    answer, 8x the tokens a server (public: ~1.5M bf16); auto follows the cache, up to 01b's bound of 256.
    The capturing server cannot use DCP (a speculative method): its cache is the plain one's."""
    f = planner.Flags(samples=100000, tokens_per_sample=10000, weights_gb=554)
    bf16 = planner.serving(kimi_shape(), f)
    fp8 = planner.serving(kimi_shape(), planner.Flags(**{**f.__dict__, "kv_cache_dtype": "fp8"}))
    assert fp8["kv_bytes_per_token"] == 35136 == bf16["kv_bytes_per_token"] // 2
    assert fp8["resident_tokens"] == 15.15e9 // 35136 == 431181 and fp8["worst_case"] == 24
    assert fp8["concurrency"] == int(431181 // (1024 + 6138.8)) == 60 > bf16["concurrency"] == 30
    dcp = planner.serving(kimi_shape(), planner.Flags(**{**f.__dict__, "dcp": 8}))
    assert dcp["resident_tokens"] == 8 * 215590 and dcp["worst_case"] == 8 * 215590 // 17408 == 99
    assert dcp["concurrency"] == 240
    both = planner.serving(kimi_shape(), planner.Flags(**{**f.__dict__, "dcp": 8, "kv_cache_dtype": "fp8"}))
    assert both["resident_tokens"] == 8 * 431181 and both["concurrency"] == gen.AUTO_MAX == 256
    # above 01b's bound is not above the cache: a fixed 198 (the worst case) plans at its own level
    rows = planner.plan(kimi_shape(), planner.Flags(**{**f.__dict__, "dcp": 8, "kv_cache_dtype": "fp8"}))
    assert [(r["concurrency"], r["over_cache"]) for r in rows["stages"]["01b"]["fixed"]] == \
        [(12, False), (32, False), (64, False), (128, False), (both["worst_case"], False)]
    cap = planner.serving(kimi_shape(), planner.Flags(**{**f.__dict__, "dcp": 8}), capture=True)
    assert cap["dcp"] == 1 and cap["resident_tokens"] == 118715
    # more answers in flight: more tok/s, fewer hours
    hours = [planner.plan(kimi_shape(), planner.Flags(**{**f.__dict__, **x}))["stages"]["01b"]["hours"]
             for x in ({}, {"kv_cache_dtype": "fp8"}, {"dcp": 8})]
    assert hours[0] > hours[1] > hours[2]


def test_a_long_tail_gives_a_level_between_the_mean_based_and_the_worst_case():
    """90 answers of 500 tokens and 10 of 15,000: mean 1,950, but a random moment falls in a long one
    74% of the time: E[a^2]/2E[a] = (90 x 500^2 + 10 x 15,000^2) / (2 x 195,000) = 5,826.9 tokens
    resident per answer beyond the prompt. Equal answers stay half-way on average: more fit."""
    tail = gen.length_stats([500] * 90 + [15000] * 10, "t")
    assert (tail["count"], tail["mean"], tail["p50"], tail["p90"], tail["p99"], tail["max"]) == \
        (100, 1950.0, 500, 500, 15000, 15000)
    assert tail["resident"] == round((90 * 500 ** 2 + 10 * 15000 ** 2) / (2 * 195000), 1) == 5826.9
    lv = gen.auto_level(215590, 1024, tail, 16384)
    assert lv == {"worst": 12, "auto": int(215590 // (1024 + 5826.9)), "fill": 31, "typical_tokens": 6851,
                  "mean_level": 215590 // (1024 + 1950)}
    assert lv["worst"] < lv["auto"] == 31 < lv["mean_level"] == 72
    even = gen.auto_level(215590, 1024, gen.length_stats([1950] * 100, "e"), 16384)
    assert even["auto"] == int(215590 // (1024 + 975)) == 107 > even["mean_level"]
    assert gen.auto_level(10000, 1024, tail, 16384)["auto"] == 0  # not one answer fits: vLLM would not start
    assert gen.auto_level(10 ** 9, 1024, tail, 16384)["auto"] == gen.AUTO_MAX


def test_the_assumed_lengths_have_the_runs_mean_and_stop_at_max_tokens():
    xs = gen.assumed_lengths(2976, 16384)
    assert len(xs) == gen.GRID and max(xs) == 16384 and abs(sum(xs) / len(xs) - 2976) < 3
    a = gen.assumed_answers(2976, 16384)
    assert a["count"] is None and a["p50"] < a["mean"] < a["p90"] < a["max"] and a["resident"] > a["mean"]
    assert gen.assumed_lengths(20000, 16384) == [16384] * gen.GRID


def test_the_curve_interpolates_the_box_and_measured_points_replace_it():
    box = gen.BOX_CURVE
    assert [gen.interpolate(box, c) for c in (1, 32, 128, 512)] == pytest.approx([98, 1130, 2250, 2250])
    assert gen.interpolate(box, 0.5) == 49 and gen.interpolate(box, 0) == 0
    assert round(gen.interpolate(box, 8)) == round(98 * 8 ** (math.log(1130 / 98) / math.log(32))) == 425
    assert gen.interpolate(box, 16) < gen.interpolate(box, 17) < gen.interpolate(box, 31)
    assert [gen.context_factor(c) for c in (1000, 2048, 9216, 16384, 40000)] == [1, 1, 0.875, 0.75, 0.75]
    # one measured point: exact there, the assumed shape scaled to it elsewhere
    one = [(20, 500.0)]
    assert gen.gen_tok_s(20, 5000, one) == pytest.approx(500.0, rel=1e-12)
    assert gen.gen_tok_s(64, 5000, one) == pytest.approx(gen.gen_tok_s(64, 5000) * 500 / gen.gen_tok_s(20, 5000))
    # two: exact at both, the ratio between them in log(level), held beyond
    two = [(8, 300.0), (32, 700.0)]
    assert gen.gen_tok_s(8, 3000, two) == pytest.approx(300) and gen.gen_tok_s(32, 3000, two) == pytest.approx(700)
    assert 300 < gen.gen_tok_s(16, 3000, two) < 700
    assert gen.gen_tok_s(128, 3000, two) == pytest.approx(gen.gen_tok_s(128, 3000) * 700 / gen.gen_tok_s(32, 3000))
    assert gen.curve_source(two, "f.json") == "measured (f.json): 300 at 8, 700 at 32 tok/s; the assumed " \
                                              "curve's shape between and beyond"


def write_gen_rates(path: Path, **extra) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"points": [{"level": 10.0, "tok_s": 400.0}, {"level": 40.0, "tok_s": 900.0}],
                                "answers": {**gen.length_stats([500] * 90 + [15000] * 10, "pilot"), "count": 100},
                                "prompt_tokens": 800, "cache_tokens": 300000, **extra}))
    return path


def test_00_reads_the_pilots_measured_rates_from_the_work_dir(tmp_path, capsys):
    """<work-dir>/pilot/gen_rates.json: its points replace the box's curve, its answers the assumed
    lengths, its cache (the server's, read by 01b) the computed one."""
    target = Path(__file__).parents[1] / "docs" / "kimi-k2.5-text-config.json"
    write_gen_rates(tmp_path / "w" / "pilot" / "gen_rates.json")
    argv = ["--target", str(target), "--samples", "25000", *KIMI, "--work-dir", str(tmp_path / "w")]
    assert stage_cli("00_plan").main([*argv, "--json"]) == 0
    g = json.loads(capsys.readouterr().out)["stages"]["01b"]
    assert g["serving"]["resident_tokens"] == 300000 and g["serving"]["measured_cache"]
    assert g["serving"]["concurrency"] == int(300000 // (800 + 5826.9)) == 45
    assert g["answers"]["mean"] == 1950 and g["tokens"] == 25000 * 1950
    rate = gen.gen_tok_s(45, 800 + 5826.9, [(10, 400.0), (40, 900.0)])
    assert g["rate_tok_s"] == pytest.approx(rate) and 900 < rate < 1000
    assert "measured (" in g["rate_source"] and "400 at 10, 900 at 40 tok/s" in g["rate_source"]
    assert stage_cli("00_plan").main(argv) == 0
    out = capsys.readouterr().out
    assert "01b KV cache 300,000 tokens a server (measured: 01b's /metrics)" in out
    assert "01b answers: 100 answers: mean 1,950, p50 500, p90 500, p99 15,000, max 15,000 tokens (measured: " in out
    # --measured names the file; another KV dtype than the pilot's: the cache is computed, the rates kept
    other = write_gen_rates(tmp_path / "m.json", kv_cache_dtype="fp8")
    assert stage_cli("00_plan").main(["--target", str(target), *KIMI, "--measured", str(other), "--json"]) == 0
    g = json.loads(capsys.readouterr().out)["stages"]["01b"]
    assert g["serving"]["resident_tokens"] == 215590 and "measured (" in g["rate_source"]


@pytest.mark.parametrize("content,needle", [
    (None, "--measured {}: no such file (the pilot writes <work-dir>/pilot/gen_rates.json)"),
    ("[1, 2", "--measured {}: not JSON"),
    ('{"points": [{"level": 0, "tok_s": 5}]}', "--measured {}: not a gen_rates.json"),
    ('{"points": [], "answers": {"mean": 0}}', "--measured {}: not a gen_rates.json"),
])
def test_a_bad_measured_file_is_one_error_line(tmp_path, capfd, content, needle):
    from eagle3_train.common.errors import run_main

    path = tmp_path / "gen_rates.json"
    if content is not None:
        path.write_text(content)
    target = Path(__file__).parents[1] / "docs" / "kimi-k2.5-text-config.json"
    assert run_main(stage_cli("00_plan").main, ["--target", str(target), *KIMI, "--measured", str(path)]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and needle.format(path) in err[0], err


def test_data_from_an_01b_output_gives_the_answers_lengths(tmp_path, capsys):
    from eagle3_train.common.config import GENERATE
    from eagle3_train.common.manifest import write_manifest

    d = tmp_path / "gen"
    d.mkdir()
    lengths = [100, 200, 300, 4000]
    (d / "raw_responses.jsonl").write_text("".join(json.dumps(
        {"id": f"q{i}", "prompt_token_ids": [1] * 50, "token_ids": [7] * n}) + "\n" for i, n in enumerate(lengths)))
    write_manifest(d, GENERATE, config={}, counts={"answered": 4, "prompt_tokens": 200, "generated_tokens": 4600})
    target = Path(__file__).parents[1] / "docs" / "kimi-k2.5-text-config.json"
    assert stage_cli("00_plan").main(["--target", str(target), *KIMI, "--data", str(d), "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    a = p["stages"]["01b"]["answers"]
    assert (a["count"], a["mean"], a["max"]) == (4, 1150, 4000) and a["source"].startswith("measured: --data")
    assert a["resident"] == round(sum(n * n for n in lengths) / (2 * 4600), 1)
    assert p["flags"]["gen_prompt_tokens"] == 50 and p["tokens"] == 4 * 1200
    # a tokenized set: the lengths from each record's stats (its supervised tokens), not its id lists
    t = tmp_path / "tok"
    t.mkdir()
    (t / "data.jsonl").write_text("".join(json.dumps({"id": f"q{i}", "input_ids": [5] * (n + 60),
                                                      "loss_mask": [0] * 60 + [1] * n,
                                                      "stats": {"prompt_len": 60, "num_supervised": n}}) + "\n"
                                          for i, n in enumerate(lengths)))
    write_manifest(t, "01c_tokenize", config={}, counts={"samples": 4, "tokens": 4840})
    assert stage_cli("00_plan").main(["--target", str(target), *KIMI, "--data", str(t), "--json"]) == 0
    a = json.loads(capsys.readouterr().out)["stages"]["01b"]["answers"]
    assert (a["count"], a["mean"], a["max"]) == (4, 1150, 4000)



def test_capture_counts_its_pinned_host_buffers_and_the_piecewise_graphs_cost():
    """The connector gathers each request's states on rank 0 into a pinned host buffer rounded up to
    a power of two and cached while the request is in flight: host memory the plan must show. The
    capturing server runs PIECEWISE CUDA graphs: its rate is the plain curve's, divided by an
    assumed cost that the plan names."""
    P = planner
    assert [P.pinned_buffer_bytes(n) for n in (1, 2, 3, 1000, 1 << 30, (1 << 30) + 1)] == \
        [1, 2, 4, 1024, 1 << 30, 1 << 31]
    shape, f = kimi_shape(), planner.Flags(samples=25000, tokens_per_sample=4000, weights_gb=554)
    p = P.plan(shape, f)
    row, serve = p["capture"]["01b"], p["capture"]["01b"]["serving"]
    in_flight = serve["concurrency"] * serve["servers"]
    one = P.pinned_buffer_bytes(serve["request_tokens"] * serve["hidden_bytes_per_token"])
    assert row["host_memory"] == in_flight * one and one >= serve["request_tokens"] * serve["hidden_bytes_per_token"]
    assert "PIECEWISE" in row["rate_source"]
    plain = P.gen_rate(serve, P.with_measured(f, P.serving(shape, f)))[0]
    assert row["rate_tok_s"] == pytest.approx(plain / P.CAPTURE_PIECEWISE_COST)
    assert any("pinned buffers" in line for line in stage.capture_lines(p, lambda x: f"{x / 1e9:.1f} GB"))
