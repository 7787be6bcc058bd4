"""01b_generate_synthetic's settings and output file names."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from eagle3_train.common.config import GENERATE, StageConfig, require, setting
from eagle3_train.generate.capture_settings import HIDDEN, REQUESTS, CaptureSettings
from eagle3_train.tokenize.config import TokenizeSettings

RAW = "raw_responses.jsonl"
ERRORS = "errors.jsonl"
PROGRESS_LOG = "progress.log"
TRANSPORTS = ("aiohttp", "httpx")


@dataclass(kw_only=True)
class GenerateConfig(CaptureSettings, TokenizeSettings, StageConfig):
    """What makes records one data set (not resumable): the input, the model and the sampling.
    Endpoints, concurrency, timeouts, retries, --limit and --shard only decide how and how much is
    generated, so they may change between a run and its resume; --allow-text-fallback decides what
    an id-less answer becomes, so it may not."""

    stage: ClassVar[str] = GENERATE
    outputs: ClassVar[tuple[str, ...] | None] = (RAW, ERRORS, PROGRESS_LOG, "tokenized", HIDDEN, REQUESTS)
    claims: ClassVar[tuple[str, ...]] = (RAW,)

    # input (compared as resolved: the source's path or name, and the split of a dataset)
    input: str = setting(resume=True, help="prompts: a .jsonl/.json file, a saved dataset dir, or a hub dataset name")
    split: str = setting("train", resume=True, help="dataset split")
    dataset_config: str | None = setting(None, help="dataset config name (default: none)")
    id_field: str | None = setting(None, resume=True, help=(
        "field holding the sample id (default: id/prompt_id/conversation_id/uuid/idx, else a hash of the "
        "conversation)"))
    limit: int | None = setting(None, resume=True, help="use the first N prompts (default: all)")
    shard: str | None = setting(None, resume=True, help=(
        "I/N: this process takes shard I of N, by id hash (default: all)"))
    skip_invalid: bool = setting(False, resume=True, help=(
        "count and skip malformed rows instead of stopping (default: stop with an error)"))

    # output
    output_dir: Path = setting(resume=True, help="where raw_responses.jsonl etc. go")
    overwrite: bool = setting(False, resume=True, help=(
        "start over: move the previous output aside into replaced-<time>/ (default: resume)"))
    progress_every: float = setting(30.0, resume=True, help="seconds between lines in progress.log")

    # server
    base_url: list[str] = setting(resume=True, help=(
        "OpenAI-compatible endpoint, e.g. http://host:8000/v1; repeat to spread load"))
    model: str = setting(help="served model name")
    api_key: str = setting(default_factory=lambda: os.environ.get("OPENAI_API_KEY", "EMPTY"), resume=True,
                           secret=True, help=(
                               "API key; not stored in the manifest (default: $OPENAI_API_KEY, else EMPTY)"))
    concurrency: int = setting(64, resume=True, help=(
        "requests in flight in total; the preflight warns when they exceed the servers' KV cache (vLLM's "
        "/metrics) and names the concurrency that keeps answers resident (default: 64)"))
    timeout: float = setting(3600.0, resume=True, help=(
        "seconds for one attempt, end to end; long reasoning needs minutes (default: 3600)"))
    connect_timeout: float = setting(30.0, resume=True, help="seconds to connect (default: 30)")
    max_retries: int = setting(5, resume=True, help="retries after timeouts, connection errors, 429 and 5xx")
    backoff_base: float = setting(2.0, resume=True, help=(
        "first retry waits ~this many seconds, doubling each time (default: 2)"))
    backoff_max: float = setting(120.0, resume=True, help="longest wait between retries (default: 120)")
    abort_after: int = setting(64, resume=True, help=(
        "stop when this many samples in a row fail after retries; 0 = never (default: 64)"))
    transport: str = setting("aiohttp", resume=True, help="HTTP layer under the openai SDK")
    no_preflight: bool = setting(False, resume=True, help=(
        "skip checking that each endpoint serves --model and holds --concurrency answers in its KV cache "
        "(default: check)"))
    # Not resumable: it decides whether an id-less answer is written (text-derived) or fails, so a
    # run's records are either all the server's ids or were allowed text fallback from the start.
    allow_text_fallback: bool = setting(False, help=(
        "an answer without token ids (SGLang, a hosted API) gets ids re-wrapped from its reasoning/content "
        "with --tokenizer, marked source=text and counted, as 01a_import_text.py does (default: refuse it; "
        "inexact, see 01a)"))

    # sampling
    max_tokens: int | None = setting(None, help="max generated tokens (default: up to the context)")
    temperature: float | None = setting(None, help=(
        "sampling temperature (default: the server's, i.e. the model's generation config)"))
    top_p: float | None = setting(None, help="nucleus sampling (default: server's)")
    seed: int | None = setting(None, help="base seed; each sample gets seed+hash(id) (default: unseeded)")
    extra_body: dict = setting(default_factory=dict, help=(
        'JSON merged into every request, e.g. \'{"top_k": 20}\'; 01b always sends '
        '"spaces_between_special_tokens": false unless this overrides it (default: {})'))

    tokenize: bool = setting(False, resume=True, help=(
        "also write <output-dir>/tokenized/ (training JSONL) when generation is done"))

    def validate(self):
        require(self.concurrency >= 1, f"--concurrency must be positive, not {self.concurrency}")
        require(self.max_retries >= 0, f"--max-retries must not be negative, not {self.max_retries}")
        require(self.timeout > 0, f"--timeout must be positive, not {self.timeout}")
        require(self.connect_timeout > 0, f"--connect-timeout must be positive, not {self.connect_timeout}")
        require(self.backoff_base >= 0, f"--backoff-base must not be negative, not {self.backoff_base}")
        require(self.backoff_max >= 0, f"--backoff-max must not be negative, not {self.backoff_max}")
        require(self.abort_after >= 0, f"--abort-after must not be negative (0 = never), not {self.abort_after}")
        require(self.limit is None or self.limit >= 1, f"--limit must be >= 1, not {self.limit}")
        # Sampling values the server would reject on every request (400) or silently misread.
        require(self.max_tokens is None or self.max_tokens >= 1,
                f"--max-tokens must be at least 1, not {self.max_tokens}")
        require(self.temperature is None or (math.isfinite(self.temperature) and self.temperature >= 0),
                f"--temperature must not be negative (0 = greedy), not {self.temperature}")
        require(self.top_p is None or (math.isfinite(self.top_p) and 0 < self.top_p <= 1),
                f"--top-p must lie in (0, 1], not {self.top_p}")
        require(self.transport in TRANSPORTS, f"--transport {self.transport!r}: choose aiohttp or httpx")
        require(isinstance(self.extra_body, dict), "--extra-body must be a JSON object")
        require(self.progress_every >= 0, f"--progress-every must not be negative, not {self.progress_every}")
        self.validate_tokenization()
        self.validate_capture()
