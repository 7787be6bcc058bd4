"""01b's --capture-hidden-states settings: 02's storage and server flags, reused (torch-free).

The store's flags (--layers, --storage, --topk, --shard-mb) and the server's (--launch-server,
--hidden-states-dir, --tensor-parallel-size, ...) are 02's fields: the same defaults and help, and
checked by 02's own validation (a throwaway ExtractConfig), so the two paths never drift apart.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from eagle3_train.common.config import Settings, require, setting
from eagle3_train.common.formats import STORAGES
from eagle3_train.extract.config import ExtractConfig

from eagle3_train.common.layout import HIDDEN, REQUESTS  # noqa: F401 -- named here too (capture.py, tests)


def _like_02(name: str, *, resume: bool, help: str | None = None):  # noqa: A002
    """02's field `name` (default and help), with this stage's resume policy."""
    f = ExtractConfig.field_of(name)
    return setting(f.default, help=help or f.metadata["help"], resume=resume)


@dataclass(kw_only=True)
class CaptureSettings(Settings):
    """What the capture stores is part of the data set (not resumable): the target, the layers, the
    storage and (in GenerateConfig's rerun inputs) the tokenization that cuts the rows. How the
    server is reached or started may change on a resume."""

    capture_hidden_states: bool = setting(False, help=(
        "also keep the target's hidden states of every answer, saved by vLLM while it generates (no second "
        "prefill by 02): <output-dir>/hidden/ is a store in 02's format; the server must run with the "
        "printed extract_hidden_states command (or pass --launch-server) (default: off)"))
    target: str | None = setting(None, help=(
        "with --capture-hidden-states: the target checkpoint (folder or hub id) for its layer count, the "
        "top-k head and --launch-server (default: --model)"))
    layers: str | None = _like_02("layers", resume=False)
    storage: str = _like_02("storage", resume=False)
    topk: int = _like_02("topk", resume=False)
    shard_mb: float = _like_02("shard_mb", resume=True, help=(
        "target shard size in MB; shards are cut in the order answers finish (default: 1024)"))
    hidden_states_dir: Path | None = _like_02("hidden_states_dir", resume=True)
    launch_server: bool = _like_02("launch_server", resume=True)
    tensor_parallel_size: int = _like_02("tensor_parallel_size", resume=True)
    max_num_batched_tokens: int = _like_02("max_num_batched_tokens", resume=True)
    max_model_len: int | None = _like_02("max_model_len", resume=True, help=(
        "for the printed/launched server (default: the target's max_position_embeddings)"))
    startup_timeout: float | None = _like_02("startup_timeout", resume=True)
    vllm_args: str = _like_02("vllm_args", resume=True, help=(
        "more flags for the printed/launched server, one string, e.g. '--reasoning-parser kimi_k2 "
        "--gpu-memory-utilization 0.85' (default: none)"))
    max_store_gb: float | None = _like_02("max_store_gb", resume=True, help=(
        "back-pressure for 04 --follow --consume: send no new request while the store's shards on disk (and those "
        "being written) and the server's per-request files not yet read exceed this many GB (1e9 bytes); the store "
        "then holds at most it plus the shard being filled plus --concurrency answers in flight (default: no bound)"))
    device: str = _like_02("device", resume=True, help=(
        "where --storage fp8-topk's head (final norm + lm_head) runs: auto, cpu, cuda:1 ... (default: auto = "
        "the GPU with the most free memory if it fits there, else cpu)"))

    def validate_capture(self) -> None:
        if not self.capture_hidden_states:  # without a server to print or launch, --base-url is needed
            require(bool(getattr(self, "base_url", True)), "--base-url is required (an OpenAI-compatible "
                                                           "endpoint, e.g. http://127.0.0.1:8000/v1)")
            require(not self.launch_server, "--launch-server starts the capturing server: it needs "
                                            "--capture-hidden-states")
            idle = self.given(*CAPTURE_ONLY)
            require(not idle, f"{', '.join(idle)}: read only by the hidden-state capture; add "
                              f"--capture-hidden-states or drop {'them' if len(idle) > 1 else 'it'}")
            return
        require(not getattr(self, "allow_text_fallback", False),
                "--capture-hidden-states needs the server's own token ids: it excludes --allow-text-fallback")
        # the layer count and the top-k head come from the checkpoint: a served name is usually no
        # folder here, and as a hub id it would be looked up online, late, in transformers' words
        model = getattr(self, "model", None)
        require(bool(self.target) or (model is not None and Path(model).is_dir()),
                f"--capture-hidden-states needs --target, the target's checkpoint folder (or hub id): --model "
                f"{model!r} is the served name and no folder here")
        # 02's checks, one line each, on the same values (storage, top-k, shard size, batching, startup).
        ExtractConfig(input=Path("."), output_dir=Path("."), model=self.target or getattr(self, "model", "?"),
                      backend="vllm", **{f: getattr(self, f) for f in CHECKED_BY_02})


# the flags that only the capture reads (--launch-server has its own line above)
CAPTURE_ONLY = ("target", "layers", "storage", "topk", "shard_mb", "hidden_states_dir", "tensor_parallel_size",
                "max_num_batched_tokens", "max_model_len", "startup_timeout", "vllm_args", "max_store_gb", "device")
CHECKED_BY_02 = ("layers", "storage", "topk", "shard_mb", "tensor_parallel_size", "max_num_batched_tokens",
                 "startup_timeout", "device", "max_store_gb")


def add_capture_args(parser: argparse.ArgumentParser, C=CaptureSettings) -> None:
    g = parser.add_argument_group("hidden states (captured while generating; the same store as 02's)")
    g.add_argument("--capture-hidden-states", action="store_true", **C.arg("capture_hidden_states"))
    g.add_argument("--target", **C.arg("target"))
    g.add_argument("--layers", **C.arg("layers"))
    g.add_argument("--storage", choices=STORAGES, **C.arg("storage"))
    g.add_argument("--topk", type=int, **C.arg("topk"))
    g.add_argument("--shard-mb", type=float, **C.arg("shard_mb"))
    g.add_argument("--hidden-states-dir", **C.arg("hidden_states_dir"))
    g.add_argument("--launch-server", action="store_true", **C.arg("launch_server"))
    g.add_argument("--tensor-parallel-size", type=int, **C.arg("tensor_parallel_size"))
    g.add_argument("--max-num-batched-tokens", type=int, **C.arg("max_num_batched_tokens"))
    g.add_argument("--max-model-len", type=int, **C.arg("max_model_len"))
    g.add_argument("--startup-timeout", type=float, **C.arg("startup_timeout"))
    g.add_argument("--vllm-args", **C.arg("vllm_args"))
    g.add_argument("--max-store-gb", type=float, **C.arg("max_store_gb"))
    g.add_argument("--device", **C.arg("device"))
