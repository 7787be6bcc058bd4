"""00's settings: the run to plan. Torch-free, like every stage's config; the defaults follow the
stages' own (02's storage, 03's vocabulary, 04's batch, TTT steps, draft and attention)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from eagle3_train.common.config import Settings, require, setting
from eagle3_train.common.formats import ATTNS, DRAFT_ARCHS, STORAGES, TARGET_LAYERS, dflash_block, dflash_target_layers

KV_DTYPES = ("auto", "fp8")  # vllm serve --kv-cache-dtype values 00 models
RATED_STAGES = ("01b", "02", "04", "05")  # the stages whose tok/s a --rate-<stage> flag overrides
# --gpu-memory-gb on a machine without a CUDA GPU (planning ahead of the box): its cards' label
ASSUMED_GPU_GB = 96.0


@dataclass(kw_only=True)
class PlanConfig(Settings):
    stage: ClassVar[str] = "00_plan"

    target: str = setting(help="target model dir/name or a config JSON file")
    data: str | None = setting(None, help=(
        "a tokenized set (01c output) or an 01b output: its real sample count and answers' lengths"))
    samples: int = setting(100000, help="samples (default: 100000; --data overrides)")
    tokens_per_sample: float = setting(10000.0, help="mean tokens per sample (default: 10000; --data overrides)")
    storage: str = setting("bf16", help="02's --storage")
    topk: int = setting(32, help="02's --topk for fp8-topk")
    n_aux: int = setting(3, help="auxiliary layers 02 stores and the draft reads")
    draft_vocab_size: int = setting(32000, help="03's draft vocabulary")
    max_tokens_per_batch: int = setting(4096, help="04's batch")
    ttt_steps: int = setting(3, help="04's TTT steps")
    epochs: int | None = setting(None, help="04's epochs (default: 04's rule, the fewest that reach 1,000 steps, "
                                            "at most 10)")
    draft_arch: str = setting("auto", help="04's --draft-arch (auto: the MLA layer for an MLA target, else the "
                                           "Llama layer; dflash: the DFlash block draft)")
    draft_layers: int = setting(1, help="04's --draft-layers (default: 04's, 1)")
    target_layers: str = setting("aux", help="04's --target-layers: aux (the draft reads --n-aux layers) or "
                                             "per-draft-layer (a DFlash draft reads one target layer per draft "
                                             "layer: 02 stores --draft-layers of them, by the rule 04 and 02 "
                                             "--layers dflash:N follow) (default: aux)")
    num_speculative_tokens: int | None = setting(None, help="04's --num-speculative-tokens (default: 04's, 3; "
                                                            "a DFlash draft's block - 1)")
    block_size: int | None = setting(None, help="04's --block-size (default: 04's, 8, or "
                                                "--num-speculative-tokens + 1 if larger)")
    attn: str = setting("auto", help="04's attention (auto: flex, as on CUDA)")
    train_embeddings: bool = setting(False, help="04 trains embed_tokens (default: frozen)")
    train_lm_head: bool = setting(False, help="04 trains lm_head (default: frozen)")
    gpus: int = setting(8, help="GPUs")
    gpu_memory_gb: float | None = setting(None, help=(
        "memory per GPU in GB (default: what torch reports for GPU 0, e.g. ~102.6 for an RTX PRO 6000; "
        f"without a CUDA GPU here {ASSUMED_GPU_GB:g}, noted)"))
    gpu_memory_utilization: float = setting(0.9, help="01b's vllm serve --gpu-memory-utilization (default: 0.9, "
                                                      "vLLM's)")
    weights_gb: float | None = setting(None, help=(
        "the target's weights in GB, for 01b's KV cache (default: the model folder's weight files; "
        "Kimi-K2.5 INT4: ~554)"))
    gen_servers: int = setting(1, help="01b's vLLM servers, each over --gpus / --gen-servers GPUs (default: 1)")
    kv_cache_dtype: str = setting("auto", help=(
        "01b's vllm serve --kv-cache-dtype: auto (the model's) or fp8 (twice the answers in the cache; changes the "
        "target's numerics: generate, extract and evaluate with the dtype you serve with) (default: auto)"))
    decode_context_parallel_size: int = setting(1, help=(
        "01b's vllm serve --decode-context-parallel-size: each of that many ranks keeps 1/N of every answer's "
        "cache (N times the answers; not with speculative decoding on TRITON_MLA: 01b and 02 only) (default: 1)"))
    measured: str | None = setting(None, help=(
        "gen_rates.json (the pilot's): 01b's tok/s at the levels it ran and its answers' lengths, in place of "
        "the assumed curve and lengths (default: <work-dir>/pilot/gen_rates.json when there)"))
    work_dir: str | None = setting(None, help=(
        "the run's work directory: 01b's rates and lengths from the pilot's pilot/gen_rates.json when there "
        "(default: none)"))
    gen_prompt_tokens: int = setting(1024, help="01b's mean prompt in tokens (default: 1024)")
    gen_max_tokens: int = setting(16384, help="01b's --max-tokens (default: 16384)")
    rate_01b: float | None = setting(None, help="01b's tok/s over all servers (default: see the table)")
    rate_02: float | None = setting(None, help="02's tok/s over all GPUs (default: see the table)")
    rate_04: float | None = setting(None, help="04's tok/s over all GPUs (default: see the table)")
    rate_05: float | None = setting(None, help="05's tok/s over all GPUs (default: see the table)")
    json: bool = setting(False, help="print the plan as JSON instead of the table")

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        for name in ("samples", "tokens_per_sample", "topk", "n_aux", "draft_layers", "draft_vocab_size",
                     "max_tokens_per_batch", "ttt_steps", "gpus", "gpu_memory_gb", "gen_servers", "gen_prompt_tokens",
                     "gen_max_tokens"):
            value = getattr(self, name)
            require(value is None or value > 0, f"--{name.replace('_', '-')} must be positive, not {value}")
        require(self.epochs is None or self.epochs >= 1, f"--epochs must be at least 1, not {self.epochs}")
        require(self.num_speculative_tokens is None or self.num_speculative_tokens > 0,
                f"--num-speculative-tokens must be positive, not {self.num_speculative_tokens}")
        require(self.block_size is None or self.block_size >= 2,
                f"--block-size must be at least 2 (the anchor and a mask token), not {self.block_size}")
        require(0 < self.gpu_memory_utilization <= 1,
                f"--gpu-memory-utilization must lie in (0, 1], not {self.gpu_memory_utilization}")
        require(self.weights_gb is None or self.weights_gb > 0, f"--weights-gb must be positive, not {self.weights_gb}")
        require(self.gen_servers <= self.gpus,
                f"--gen-servers {self.gen_servers} needs at least as many --gpus, not {self.gpus}")
        require(self.data is not None or self.tokens_per_sample > self.gen_prompt_tokens,
                f"--tokens-per-sample {self.tokens_per_sample:g} must exceed --gen-prompt-tokens "
                f"{self.gen_prompt_tokens} (a sample is its prompt and its answer)")
        require(self.kv_cache_dtype in KV_DTYPES,
                f"--kv-cache-dtype {self.kv_cache_dtype!r}: choose one of {', '.join(KV_DTYPES)}")
        tp = self.gpus // self.gen_servers
        require(self.decode_context_parallel_size >= 1 and tp % self.decode_context_parallel_size == 0,
                f"--decode-context-parallel-size {self.decode_context_parallel_size} must divide a server's "
                f"{tp} GPUs (--gpus / --gen-servers)")
        for stage in RATED_STAGES:
            rate = getattr(self, f"rate_{stage}")
            require(rate is None or rate > 0, f"--rate-{stage} must be positive, not {rate}")
        require(self.storage in STORAGES, f"--storage {self.storage!r}: choose one of {', '.join(STORAGES)}")
        require(self.draft_arch in DRAFT_ARCHS,
                f"--draft-arch {self.draft_arch!r}: choose one of {', '.join(DRAFT_ARCHS)}")
        require(self.attn in ATTNS, f"--attn {self.attn!r}: choose one of {', '.join(ATTNS)}")
        # 04's own rules for the flags it shares with 00 (train/config.py: check_block), so a plan
        # never describes a run 04 would refuse
        if self.draft_arch == "dflash":
            block = dflash_block(self.block_size, self.num_speculative_tokens)
            require(self.num_speculative_tokens is None or self.num_speculative_tokens <= block - 1,
                    f"--num-speculative-tokens {self.num_speculative_tokens} drafts past the block "
                    f"(--block-size {block} drafts {block - 1})")
            require(self.attn != "eager", "--attn eager cannot train a DFlash draft (its block mask would be added "
                                          "to the scores, not applied): use --attn sdpa or flex, or leave auto")
        else:
            require(self.block_size is None, "--block-size shapes a block draft: add --draft-arch dflash or drop it")
            require(not self.given("target_layers"),
                    "--target-layers shapes a block draft: add --draft-arch dflash or drop it")
        require(self.target_layers in TARGET_LAYERS,
                f"--target-layers {self.target_layers!r}: choose one of {', '.join(TARGET_LAYERS)}")
        require(self.target_layers == "aux" or not self.given("n_aux"),
                "--target-layers per-draft-layer stores --draft-layers target layers; --n-aux names another "
                "count: drop one")
        require(self.draft_layers == 1 or self.draft_arch != "mla",
                f"--draft-layers {self.draft_layers}: the MLA draft has one layer (04 builds no more)")
        require(self.storage == "fp8-topk" or not self.given("topk"),
                "--topk is the k of --storage fp8-topk: add --storage fp8-topk or drop --topk")

    def stored_layers(self, num_layers: int) -> int:
        """The target layers 02 stores for this run: --n-aux, or one per draft layer (their count; the
        rule refuses a draft deeper than the target allows)."""
        if self.target_layers != "per-draft-layer":
            return self.n_aux
        return len(dflash_target_layers(num_layers, self.draft_layers))

    def rates(self) -> dict:
        return {s: getattr(self, f"rate_{s}") for s in RATED_STAGES}


def gpu0_memory_gb() -> float | None:
    """GPU 0's memory in GB (1e9 bytes) as torch reports it, None without a CUDA GPU. torch (seconds
    to import) is loaded only when the NVIDIA driver lists a GPU, so 00 stays quick on a laptop."""
    from eagle3_train.common.vllm_server import has_nvidia_gpu

    if not has_nvidia_gpu():
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(0).total_memory / 1e9


def gpu_memory_gb(given: float | None, *, note=None) -> float:
    """--gpu-memory-gb, else GPU 0's (a label's 96 GB undercounts the RTX PRO 6000's ~102.6), else
    ASSUMED_GPU_GB with a one-line note on stderr (stdout may be --json)."""
    if given is not None:
        return given
    probed = gpu0_memory_gb()
    if probed:
        return round(probed, 1)
    (note or _stderr)(f"note: no CUDA GPU here: --gpu-memory-gb assumed {ASSUMED_GPU_GB:g} (pass your GPUs' memory)")
    return ASSUMED_GPU_GB


def _stderr(line: str) -> None:
    import sys

    print(line, file=sys.stderr)
