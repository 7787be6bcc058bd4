"""01b_generate_synthetic's settings and output file names."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from eagle3_train.common.config import GENERATE, StageConfig, require, setting
from eagle3_train.common.layout import ERRORS, PROGRESS_LOG, RAW, RAW_DIR_OUTPUTS  # noqa: F401 -- named here too
from eagle3_train.common.server_wait import WAIT_DEFAULT_S, WAIT_HELP, check_url, check_wait
from eagle3_train.common.errors import PipelineError
from eagle3_train.generate.capture_settings import CaptureSettings
from eagle3_train.generate.concurrency import EVERY_S, FIXED
from eagle3_train.tokenize.config import TokenizeSettings

TRANSPORTS = ("aiohttp", "httpx")
# --extra-body keys with a flag of their own, or that 01b sets (one whole answer per request, its ids)
EXTRA_BODY_OWNED = {"model": "pass --model", "messages": "the prompts come from --input",
                    "max_tokens": "pass --max-tokens", "max_completion_tokens": "pass --max-tokens",
                    "temperature": "pass --temperature", "top_p": "pass --top-p", "seed": "pass --seed",
                    "chat_template_kwargs": "pass --chat-template-kwargs", "stream": "01b reads whole answers",
                    "n": "01b keeps one answer per prompt"}
AUTO = "auto"


@dataclass(kw_only=True)
class GenerateConfig(CaptureSettings, TokenizeSettings, StageConfig):
    """What makes records one data set (not resumable): the input, the model and the sampling.
    Endpoints, concurrency, timeouts, retries, --limit and --shard only decide how and how much is
    generated, so they may change between a run and its resume; --allow-text-fallback decides what
    an id-less answer becomes, so it may not."""

    stage: ClassVar[str] = GENERATE
    outputs: ClassVar[tuple[str, ...] | None] = RAW_DIR_OUTPUTS
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
    concurrency: int | str = setting("auto", resume=True, help=(
        "requests in flight: auto = steered per endpoint by the server's live load (vLLM's /metrics: KV cache use, "
        "requests waiting, preemptions, tokens/s), at most --max-concurrency; a server without those gauges gets "
        f"a fixed {FIXED}. A number pins the total; the preflight warns when it exceeds the servers' KV cache and "
        "names the concurrency that keeps answers resident (default: auto)"))
    max_concurrency: int = setting(256, resume=True, help=(
        "with --concurrency auto: the most requests in flight per endpoint"))
    concurrency_every: float = setting(EVERY_S, resume=True, help=(
        "with --concurrency auto: seconds between readings of each server's /metrics"))
    timeout: float = setting(3600.0, resume=True, help=(
        "seconds for one attempt, end to end; long reasoning needs minutes (default: 3600)"))
    connect_timeout: float = setting(30.0, resume=True, help="seconds to connect (default: 30)")
    wait_for_server: float = setting(WAIT_DEFAULT_S, resume=True, help=WAIT_HELP)
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

    @property
    def auto(self) -> bool:
        return self.concurrency == AUTO

    @property
    def most_in_flight(self) -> int:
        """The most requests one server gets: its connection pool, a launched server's --max-num-seqs."""
        return self.max_concurrency if self.auto else self.concurrency

    def check_extra_body(self) -> None:
        """--extra-body rides on every request: keys that 01b or another flag sets, or that would
        change what one request returns, are refused before any request."""
        owned = {k: flag for k, flag in EXTRA_BODY_OWNED.items() if k in self.extra_body}
        require(not owned, "--extra-body sets " + ", ".join(f"{k!r} ({why})" for k, why in owned.items())
                + ": drop it from --extra-body")
        kv = self.extra_body.get("kv_transfer_params")
        require(kv is None or isinstance(kv, dict),
                f"--extra-body's kv_transfer_params must be a JSON object (vLLM's connector parameters), not {kv!r}")

    def check_endpoints(self) -> None:
        """Each --base-url a reachable URL, and each once: a repeated one would get twice the load."""
        seen: dict[str, str] = {}
        for url in self.base_url or ():
            check_url("--base-url", url)
            key = url.rstrip("/")
            require(key not in seen, f"--base-url {url!r} repeats {seen.get(key)!r}: give each endpoint once")
            seen[key] = url

    def validate(self):
        if isinstance(self.concurrency, str) and self.concurrency != AUTO:
            try:
                self.concurrency = int(self.concurrency)
            except ValueError:
                raise PipelineError(f"--concurrency must be auto or a positive number, not {self.concurrency!r}") \
                    from None
        require(self.auto or self.concurrency >= 1,
                f"--concurrency must be positive (or auto), not {self.concurrency}")
        require(self.max_concurrency >= 1, f"--max-concurrency must be positive, not {self.max_concurrency}")
        require(self.concurrency_every > 0 and math.isfinite(self.concurrency_every),
                f"--concurrency-every must be positive (seconds), not {self.concurrency_every}")
        # the controller's flags steer --concurrency auto only; beside a number they would be ignored
        steering = self.given("max_concurrency", "concurrency_every")
        require(self.auto or not steering,
                f"{', '.join(steering)}: read only with --concurrency auto, and --concurrency is "
                f"{self.concurrency}: drop {'them' if len(steering) > 1 else 'it'}, or pass --concurrency auto")
        self.check_endpoints()
        require(self.max_retries >= 0, f"--max-retries must not be negative, not {self.max_retries}")
        require(self.timeout > 0, f"--timeout must be positive, not {self.timeout}")
        require(self.connect_timeout > 0, f"--connect-timeout must be positive, not {self.connect_timeout}")
        check_wait(self.wait_for_server)
        require(bool(self.base_url) or not self.given("wait_for_server"),
                "--wait-for-server waits for a server at --base-url; a launched or printed capture server "
                "is waited for by --startup-timeout: drop --wait-for-server")
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
        self.check_extra_body()
        # the tokenization flags shape tokenized/, the text fallback's ids and the capture's rows: nothing else
        unread = self.given("tokenizer", "think_start_id", "think_end_id", "end_of_turn_id", "max_seq_len", "loss_on",
                            "keep_length")
        require(self.tokenize or self.allow_text_fallback or self.capture_hidden_states or not unread,
                f"{', '.join(unread).replace('--keep-length', '--drop-length')}: read only with --tokenize (or "
                "--allow-text-fallback, --capture-hidden-states); add --tokenize or drop "
                f"{'them' if len(unread) > 1 else 'it'}")
        require(self.progress_every >= 0, f"--progress-every must not be negative, not {self.progress_every}")
        self.validate_tokenization()
        self.validate_capture()
