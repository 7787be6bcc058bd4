"""02_extract_hidden_states' settings."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from eagle3_train.common.config import EXTRACT, StageConfig, require, setting
from eagle3_train.common.formats import STORAGES
from eagle3_train.common.server_wait import WAIT_DEFAULT_S, WAIT_HELP, check_url, check_wait
from eagle3_train.common.vllm_server import STARTUP_HELP

BACKENDS = ("hf", "vllm")
DTYPES = ("auto", "bfloat16", "float16", "float32")
# the flags only the vllm backend reads
VLLM_ONLY = ("server_url", "launch_server", "hidden_states_dir", "concurrency", "tensor_parallel_size",
             "max_num_batched_tokens", "max_model_len", "request_timeout", "startup_timeout", "served_model_name",
             "vllm_args", "wait_for_server")


@dataclass(kw_only=True)
class ExtractConfig(StageConfig):
    stage: ClassVar[str] = EXTRACT
    outputs: ClassVar[tuple[str, ...] | None] = None  # --overwrite moves the whole store aside
    claims: ClassVar[tuple[str, ...]] = ("plan.json",)  # hidden_store.PLAN (that module imports torch)

    # What the shards hold is fixed by the input's hash, the target, the layers and the storage;
    # those are compared as resolved (rerun inputs), so the flags that name them may be respelled.
    input: Path = setting(help="tokenized training set directory (data.jsonl + manifest)", resume=True)
    output_dir: Path = setting(help="store directory (shards, index, plan, manifest)", resume=True)
    overwrite: bool = setting(False, resume=True,
                              help="move an existing output into replaced-<time>/ and start over (default: resume)")
    progress_every: float = setting(30.0, resume=True, help="seconds between lines in progress.log")

    # target
    model: str = setting(help="target model directory or name", resume=True)
    tokenizer: str | None = setting(None, resume=True,
                                    help="tokenizer to check the input against (default: the target's)")
    backend: str = setting("hf", resume=True,
                           help="hf: transformers on CPU/GPU(s); vllm: a vLLM server with extract_hidden_states "
                                "(default: hf)")
    layers: str | None = setting(None, resume=True,
                                 help="auxiliary layer ids, comma-separated; id i = input of layer i; "
                                      "dflash:N = the N layers a DFlash draft of N layers reads with 04 "
                                      "--target-layers per-draft-layer (default: vLLM's 2,N//2,N-3)")
    dtype: str = setting("auto", resume=True,
                         help="compute dtype of the hf target (default: auto = bfloat16 on GPU, float32 on CPU)")
    device: str = setting("auto", resume=True,
                          help="the hf target's device, or the vllm backend's top-k head's (--storage fp8-topk): "
                               "auto, cpu, cuda, cuda:1 ... (default: auto = cuda:LOCAL_RANK for hf; for the "
                               "vllm backend's head the GPU with the most free memory if it fits there, else cpu)")
    device_map: str | None = setting(None, resume=True,
                                     help="hf device_map for a target larger than one GPU, e.g. auto (default: none)")

    # storage
    storage: str = setting("bf16", help=(
        "bf16/fp16/fp32: aux + last as is; fp8: e4m3 with a scale per token and layer (~50%% of bf16); "
        "fp8-topk: fp8 aux + the target's top-k next-token log-probs instead of the last hidden state "
        "(~38%% at Kimi-K2.5 size) (default: bf16)"))
    topk: int = setting(32, resume=True, help="k for --storage fp8-topk")
    shard_mb: float = setting(1024.0, resume=True,
                              help="target shard size in MB (fixed in plan.json at the first run) (default: 1024)")

    # batching and parallelism
    batch_tokens: int = setting(16384, resume=True, help="hf: max batch size x longest sample per forward")
    max_batch_size: int = setting(64, resume=True, help="hf: max samples per forward")
    rank: int | None = setting(None, resume=True, help="this process's rank (default: $RANK or 0)")
    world_size: int | None = setting(None, resume=True,
                                     help="number of processes splitting the shards (default: $WORLD_SIZE or 1)")

    # vllm backend
    server_url: str | None = setting(None, resume=True, help=(
        "base URL of a running server started with the printed command, e.g. http://127.0.0.1:8000/v1 "
        "(default: none: print the command and exit)"))
    launch_server: bool = setting(False, resume=True,
                                  help="start the vLLM server here for the duration of the run (default: no)")
    hidden_states_dir: Path | None = setting(None, resume=True, help=(
        "where the server's connector writes per-request files (default: OUTPUT/.vllm-requests)"))
    concurrency: int = setting(32, resume=True, help="requests in flight")
    tensor_parallel_size: int = setting(1, resume=True, help="for the printed/launched server")
    max_num_batched_tokens: int = setting(8192, resume=True,
                                          help="for the printed/launched server: tokens per scheduler step; a "
                                               "longer sample is prefilled in chunks")
    max_model_len: int | None = setting(None, resume=True,
                                        help="for the printed/launched server (default: longest sample + 1)")
    request_timeout: float = setting(600.0, resume=True, help="seconds per request (default: 600)")
    startup_timeout: float | None = setting(None, resume=True, help=f"with --launch-server: {STARTUP_HELP}")
    wait_for_server: float = setting(WAIT_DEFAULT_S, resume=True, help=f"with --server-url: {WAIT_HELP}")
    served_model_name: str | None = setting(None, resume=True,
                                            help="model name the server answers to (default: --model)")
    vllm_args: str = setting("", resume=True, help=(
        "more flags for the printed/launched server, one string, e.g. "
        "'--gpu-memory-utilization 0.85 --enforce-eager' (default: none)"))

    max_store_gb: float | None = setting(None, resume=True, help=(
        "back-pressure for 04 --follow --consume: send no new work while the store's shards on disk exceed "
        "this many GB (1e9 bytes); the store then never holds more than it plus one shard (default: no bound)"))
    stop_when_full: bool = setting(False, resume=True, help=(
        "with --max-store-gb: once the store is full, commit the shard being written, stop the server this run "
        "launched, say so in one line and exit 0 instead of waiting for room (the one-box alternation with 04 "
        "--follow --consume; rerun to go on) (default: wait)"))

    # checks
    force: bool = setting(False, resume=True, help="start even if the disk estimate says it will not fit")
    validate_only: bool = setting(False, resume=True, help=(
        "only re-read every shard: shapes, token ids vs the input, NaN/inf (exit 2 if bad)"))
    repair: bool = setting(False, resume=True, help="validate this rank's shards, move bad ones aside, then redo them")
    dry_run: bool = setting(False, resume=True, help="print this stage's plan (disk, memory, hours) and exit, writing nothing")

    def validate(self):
        require(self.backend in BACKENDS, f"--backend {self.backend!r}: choose hf or vllm")
        require(self.storage in STORAGES, f"--storage {self.storage!r}: choose one of {', '.join(STORAGES)}")
        require(self.dtype in DTYPES, f"--dtype {self.dtype!r}: choose one of {', '.join(DTYPES)}")
        require(self.topk >= 1, f"--topk must be at least 1, not {self.topk}")
        require(self.storage == "fp8-topk" or not self.given("topk"),
                "--topk is the k of --storage fp8-topk: add --storage fp8-topk or drop --topk")
        require(self.startup_timeout is None or self.startup_timeout > 0,
                f"--startup-timeout must be positive, not {self.startup_timeout}")
        check_wait(self.wait_for_server)
        for flag, value in (("--shard-mb", self.shard_mb), ("--batch-tokens", self.batch_tokens),
                            ("--max-batch-size", self.max_batch_size), ("--concurrency", self.concurrency),
                            ("--max-num-batched-tokens", self.max_num_batched_tokens)):
            require(value > 0, f"{flag} must be positive, not {value}")
        require(self.max_store_gb is None or self.max_store_gb > 0,
                f"--max-store-gb must be positive, not {self.max_store_gb}")
        require(not self.stop_when_full or self.max_store_gb,
                "--stop-when-full stops once the store reaches --max-store-gb: add --max-store-gb")
        require(self.progress_every >= 0, f"--progress-every must not be negative, not {self.progress_every}")
        require(not (self.validate_only and self.repair), "--validate and --repair exclude each other")
        # without --backend vllm these would be ignored and the target loaded here in transformers
        served = self.given(*VLLM_ONLY)
        require(self.backend == "vllm" or not served,
                f"{', '.join(served)}: for --backend vllm (a vLLM server), but --backend is {self.backend}; "
                f"add --backend vllm or drop {'them' if len(served) > 1 else 'it'}")
        require(not (self.server_url and self.launch_server),
                "--server-url names a running server and --launch-server starts one: give one")
        if self.server_url:
            check_url("--server-url", self.server_url)
        require(bool(self.server_url) or not self.given("wait_for_server"),
                "--wait-for-server waits for the server at --server-url; a launched one is waited for by "
                "--startup-timeout: add --server-url or drop --wait-for-server")
        self.input = Path(self.input)
