"""The pilot's settings: the real run's target, prompts and server flags, and the pilot's small sizes.
Torch-free, like every stage's config."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from eagle3_train.common.config import Settings, require, setting
from eagle3_train.common.errors import PipelineError
from eagle3_train.common.formats import STORAGES
from eagle3_train.common.vllm_server import STARTUP_HELP
from eagle3_train.train.budget import parse_budget

PILOT_DIR = "pilot"  # under --work-dir
STAGE_KEYS = ("01b", "02", "03", "04", "05")  # what --stage-arg can address
BACKENDS = ("vllm", "hf")  # 02's --backend
SCREEN_READS = ("screen_only", "target", "tokenizer", "no_reasoning")  # what --screen-only uses
# The launched 01b server's context when --max-model-len is not given: the README's real run
# (--max-tokens 16384 plus room for the prompt), or less when the target's own context is shorter.
DEFAULT_MODEL_LEN = 32768


@dataclass(kw_only=True)
class PilotConfig(Settings):
    stage: ClassVar[str] = "pilot"

    # -- the real run's inputs
    target: str | None = setting(None, help="the target model dir or name, as the stages' --target/--model "
                                            "(with --screen-only: its tokenizer, default the one 01b recorded)")
    input: str | None = setting(None, help="the real run's prompts, as 01b's --input (a .jsonl/.json file, a saved "
                                           "dataset dir or a hub dataset name); the pilot takes "
                                           "--pilot-prompts of them")
    split: str = setting("train", help="dataset split of --input (01b's --split)")
    work_dir: Path | None = setting(None, help="the real run's work directory; the pilot writes only under "
                                               "<work-dir>/pilot")
    heldout_prompts: str | None = setting(None, help=(
        "05's --prompts, held-out prompts none of which 01b answers (default: the split's heldout.jsonl when --input "
        "is a 01_split_prompts train.jsonl, else --eval-prompts prompts held out of the first --pilot-prompts + "
        "--eval-prompts of --input, by 01_split_prompts' rule)"))
    tokenizer: str | None = setting(None, help="tokenizer path or name (default: --target)")
    no_reasoning: bool = setting(False, help="the target does not reason (01b's --no-reasoning; the screen skips "
                                             "its reasoning check)")

    # -- the pilot's sizes
    pilot_prompts: int = setting(64, help="prompts 01b answers (its --limit)")
    budget: str = setting("20", help="04's --budget: steps (20), or a time/token count as 04 takes it")
    eval_prompts: int = setting(16, help="05's --num-prompts (one concurrency level of that many, eagle3 only)")

    # -- 01b
    base_url: str | None = setting(None, help="a running vLLM serving the target for 01b, e.g. "
                                              "http://127.0.0.1:8000/v1 (default: launch one for 01b and stop it "
                                              "before 02)")
    model: str | None = setting(None, help="the served model name (required with --base-url; default: the target "
                                           "folder's name)")
    max_tokens: int | None = setting(None, help="01b's --max-tokens (default: 01b's, up to the context)")
    temperature: float | None = setting(None, help="01b's --temperature (default: the server's)")
    concurrency: int | str = setting("auto", help=(
        "01b's --concurrency: auto (steered by the server's load; the levels it visits are measured into "
        "gen_rates.json for 00_plan) or a fixed number (default: auto)"))
    samples: int | None = setting(None, help=(
        "the full run's prompts, for the report's 01b plan from the pilot's measured rates (default: the "
        "prompts of --input)"))
    timeout: float = setting(3600.0, help="01b's --timeout, seconds per request")

    # -- the servers the pilot or its stages launch (01b's, 02's with --extract-backend vllm, 05's)
    max_model_len: int | None = setting(None, help=f"the 01b server's --max-model-len (default: {DEFAULT_MODEL_LEN}, "
                                                   "or the target's context if shorter)")
    tensor_parallel_size: int = setting(1, help="--tensor-parallel-size of every launched server")
    reasoning_parser: str = setting("kimi_k2", help="vLLM --reasoning-parser of the 01b and 05 servers, 'none' "
                                                    "to disable")
    server_arg: list[str] = setting(default_factory=list, help="an extra vLLM argument for every launched server "
                                                               "(repeatable, as 05's --server-arg) (default: none)")
    startup_timeout: float | None = setting(None, help=STARTUP_HELP)

    # -- 02..04
    extract_backend: str = setting("vllm", help="02's --backend: vllm (launches its own server: the 1T target), "
                                                "hf (transformers: small targets, CPU)")
    storage: str | None = setting(None, help="02's --storage (default: 02's)")
    draft_vocab_size: int | None = setting(None, help="03's --draft-vocab-size (default: 03's)")
    nproc_per_node: int = setting(1, help="04's processes: more than 1 runs 04 under torchrun")
    stage_arg: list[str] = setting(default_factory=list, help=(
        "STAGE:ARG, one more flag for one stage (01b, 02, 03, 04, 05), repeatable, e.g. 04:--distributed=fsdp "
        "(default: none)"))

    screen_only: Path | None = setting(None, help="only screen this 01b output directory's answers, print the "
                                                  "verdict and exit (1 when garbled)")

    def __post_init__(self):
        for name in ("work_dir", "screen_only"):
            if getattr(self, name) is not None:
                setattr(self, name, Path(getattr(self, name)))
        self.validate()

    def validate(self) -> None:
        if self.screen_only is not None:  # the screen reads only the answers and their tokenizer
            idle = self.given(*(f.name for f in dataclasses.fields(self) if f.name not in SCREEN_READS))
            require(not idle, f"--screen-only screens an 01b output and runs nothing: drop {', '.join(idle)}")
            return
        require(bool(self.target), "--target is required (the target model dir or name)")
        require(bool(self.input), "--input is required (the real run's prompts, as 01b's --input)")
        require(self.work_dir is not None, "--work-dir is required (the pilot writes <work-dir>/pilot)")
        require(not self.base_url or bool(self.model), "--base-url needs --model, the name that server serves")
        require(not (self.base_url and self.max_model_len), "--max-model-len sets the 01b server the pilot launches; "
                                                            "with --base-url it launches none: drop it")
        if self.concurrency != "auto":  # as 01b takes it: auto or a positive number
            try:
                self.concurrency = int(self.concurrency)
            except ValueError:
                raise PipelineError(f"--concurrency must be auto or a positive number, not {self.concurrency!r}") \
                    from None
        require(self.samples is None or self.samples >= 1, f"--samples must be at least 1, not {self.samples}")
        for name in ("pilot_prompts", "eval_prompts", "concurrency", "tensor_parallel_size", "nproc_per_node"):
            if getattr(self, name) == "auto":
                continue
            value = getattr(self, name)
            require(value >= 1, f"--{name.replace('_', '-')} must be at least 1, not {value}")
        for name in ("max_tokens", "max_model_len", "draft_vocab_size"):
            value = getattr(self, name)
            require(value is None or value >= 1, f"--{name.replace('_', '-')} must be at least 1, not {value}")
        require(self.timeout > 0, f"--timeout must be positive, not {self.timeout}")
        require(self.startup_timeout is None or self.startup_timeout > 0,  # 0 would reach 01b's server as 0
                f"--startup-timeout must be positive, not {self.startup_timeout}")
        require(self.extract_backend in BACKENDS, f"--extract-backend {self.extract_backend!r}: choose vllm or hf")
        # 02's and 03's own checks, now rather than after 01b's hours
        require(self.storage is None or self.storage in STORAGES,
                f"--storage {self.storage!r}: choose one of {', '.join(STORAGES)}")
        require(not self.work_dir.exists() or self.work_dir.is_dir(),
                f"--work-dir {self.work_dir} is a file; pass the run's work directory")
        parse_budget(self.budget)
        self.stage_args  # noqa: B018 -- a malformed --stage-arg is refused before any work

    @property
    def out(self) -> Path:
        return self.work_dir / PILOT_DIR

    @property
    def stage_args(self) -> dict[str, list[str]]:
        """--stage-arg STAGE:ARG (repeatable) -> {stage: [args]}, each stage's in the order given."""
        out: dict[str, list[str]] = {k: [] for k in STAGE_KEYS}
        for item in self.stage_arg:
            key, sep, arg = item.partition(":")
            require(bool(sep) and key in STAGE_KEYS and arg.startswith("-"),
                    f"--stage-arg {item!r}: expected STAGE:--flag[=value] with STAGE one of {', '.join(STAGE_KEYS)}")
            out[key].append(arg)
        return out
