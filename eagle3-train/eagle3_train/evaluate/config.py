"""05_evaluate's settings: one typed config, built once from the arguments and validated here. The paths
and server addresses may change on a resume (`resume=True`): what they point at is identified by
content in run.json's inputs (the draft's hashes, the store's manifest, the prompts)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from eagle3_train.common import positions
from eagle3_train.common.config import EVALUATE, StageConfig, require, setting
from eagle3_train.common.server_wait import WAIT_DEFAULT_S, WAIT_HELP, check_url, check_wait
from eagle3_train.common.vllm_server import STARTUP_HELP

# 05's online arms: the draft (named eagle3 for any draft family: a DFlash draft is served with
# method dflash in it), no speculation, prompt lookup
ARMS = ("eagle3", "none", "ngram")
OFFLINE_DTYPES = ("auto", "bf16", "fp16", "fp32")
# vLLM's per-request record of the verify steps (acceptance by position): 05 sets it on the servers
# it starts that speculate, and vLLM refuses it on one that does not.
RECORD_FLAG = "--per-request-spec-decode-metrics"


@dataclass(kw_only=True)
class EvalConfig(StageConfig):
    stage: ClassVar[str] = EVALUATE
    outputs: ClassVar[tuple[str, ...] | None] = None  # --overwrite moves everything aside

    # -- inputs and output
    draft: Path = setting(help="the draft export (04's RUN/export: speculators' eagle3 or DFlash format, or "
                               "vLLM's deepseek_eagle3 format for an MLA draft)", resume=True)
    target: Path | None = setting(None, help="target model dir (default: the draft config's verifier path)",
                                  resume=True)
    output_dir: Path = setting(help="where report.json/.md/.png go", resume=True)
    overwrite: bool = setting(False, help="move the previous output aside and start over "
                                          "(default: resume it, or refuse one made with other settings)", resume=True)
    num_speculative_tokens: int | None = setting(None, help="K, drafted tokens per step (default: the draft config's)")
    k_sweep: list[int] = setting(default_factory=list, help="serve the draft at each of these K too "
                                                            "(comma-separated, e.g. 1,3,5,7; a DFlash draft of "
                                                            "block B up to B - 1; a --url eagle3 server is the one at "
                                                            "K, the others are started here): AL and output tok/s per "
                                                            "K, and the K to serve recommended, also written to "
                                                            "DRAFT/recommended_k.json (default: K alone)")
    progress_every: float = setting(10.0, help="seconds between progress.log lines", resume=True)
    position_buckets: str = setting(positions.BUCKETS, help=positions.BUCKETS_HELP)

    # -- offline simulation (no server)
    store: Path | None = setting(None, help="02's hidden-state store; its held-out samples (per 04's split) are "
                                            "used (default: no offline part)", resume=True)
    max_offline_samples: int = setting(200, help="cap on held-out samples")
    offline_tokens_per_batch: int = setting(4096, help="tokens per draft forward (a longer sample gets one "
                                                       "of its own)")
    device: str = setting("auto", help="offline draft and target head: auto = cuda when available, else cpu")
    offline_dtype: str = setting("auto", help="offline weights and hidden states: auto = bf16 on cuda, fp32 on "
                                              "cpu")

    # -- online, in vLLM
    prompts: Path | None = setting(None, help="held-out prompts JSONL (01b's input format, e.g. 01_split_prompts' "
                                              "heldout.jsonl; refused when one of its ids is among those the draft "
                                              "trained on) (default: no online part)", resume=True)
    num_prompts: int = setting(32, help="prompts per concurrency level")
    concurrency: list[int] = setting(default_factory=lambda: [1, 4, 16], help="levels, comma-separated "
                                                                               "(default: 1,4,16)")
    arms: str = setting(",".join(ARMS), help="servers to compare")
    base_url: str | None = setting(None, help="an eagle3 server already running (same as --url eagle3=URL) "
                                              "(default: start one)", resume=True)
    url: list[str] = setting(default_factory=list, help="a running server for an arm (repeatable) "
                                                        "(default: start one per arm)", resume=True)
    ngram: list[int] = setting(default_factory=lambda: [2, 5], help="ngram prompt lookup min,max (default: 2,5)")
    timeout: float = setting(600, help="per request, seconds", resume=True)
    wait_for_server: float = setting(WAIT_DEFAULT_S, help=f"with --base-url / --url: {WAIT_HELP}", resume=True)

    # -- sampling (the same in every arm; --temperature, --top-p and --seed also set the offline walk)
    max_tokens: int = setting(512, help="completion tokens per request")
    temperature: float = setting(0.0, help="0 = greedy; above 0 the offline part walks as vLLM verifies sampled "
                                           "requests (a proposal accepted with the target's probability of it), "
                                           "from the store's last hidden state or top-k")
    top_p: float = setting(1.0, help="nucleus sampling")
    seed: int = setting(0, help="sampling seed: each request gets its own from it and the prompt's id, the same "
                                "in every arm (and the offline sampled walk's)")
    sampled_repeats: int = setting(32, help="with --temperature above 0 and --store: draws of the offline sampled "
                                            "walk per sample to start with; more are drawn until its AL's "
                                            "standard error is below 0.01")

    # -- servers started here
    max_model_len: int | None = setting(None, help="vLLM --max-model-len; refused when the longest prompt + "
                                                   "--max-tokens does not fit (default: exactly that)")
    reasoning_parser: str = setting("kimi_k2", help="vLLM --reasoning-parser, 'none' to disable")
    startup_timeout: float | None = setting(None, help=STARTUP_HELP, resume=True)
    server_arg: list[str] = setting(default_factory=list, help="extra vLLM argument (repeatable)")

    def __post_init__(self):
        for name in ("draft", "target", "store", "prompts"):
            if getattr(self, name) is not None:
                setattr(self, name, Path(getattr(self, name)))
        super().__post_init__()

    def validate(self) -> None:
        positions.edges_of_flag(self.position_buckets)  # a bad --position-buckets: one line, here
        require(bool(self.store or self.prompts),
                "nothing to evaluate: pass --store (offline) and/or --prompts (online)")
        require(self.startup_timeout is None or self.startup_timeout > 0,
                f"--startup-timeout must be positive, not {self.startup_timeout}")
        for name in ("max_offline_samples", "offline_tokens_per_batch", "num_prompts", "max_tokens", "sampled_repeats"):
            value = getattr(self, name)
            require(value >= 1, f"--{name.replace('_', '-')} must be at least 1, not {value}")
        require(self.offline_dtype in OFFLINE_DTYPES,
                f"--offline-dtype must be one of {', '.join(OFFLINE_DTYPES)}, not {self.offline_dtype!r}")
        require(self.max_model_len is None or self.max_model_len >= 2,
                f"--max-model-len must be at least 2, not {self.max_model_len}")
        require(self.num_speculative_tokens is None or self.num_speculative_tokens >= 1,
                f"--num-speculative-tokens must be at least 1, not {self.num_speculative_tokens}")
        require(math.isfinite(self.temperature) and self.temperature >= 0,
                f"--temperature must not be negative (0 = greedy), not {self.temperature}")
        require(math.isfinite(self.top_p) and 0 < self.top_p <= 1, f"--top-p must lie in (0, 1], not {self.top_p}")
        require(self.timeout > 0, f"--timeout must be positive, not {self.timeout}")
        check_wait(self.wait_for_server)
        # the lists join_dash_values hands over whole, so a negative entry is named here in one line
        for name, values in (("k_sweep", self.k_sweep), ("concurrency", self.concurrency)):
            require(all(v >= 1 for v in values), f"--{name.replace('_', '-')} takes positive integers, "
                                                 f"not {','.join(map(str, values))}")
        require(bool(self.concurrency), "--concurrency needs at least one level, e.g. 1,4,16")
        for name, values in (("k_sweep", self.k_sweep), ("concurrency", self.concurrency)):
            twice = sorted({v for v in values if values.count(v) > 1})
            require(not twice, f"--{name.replace('_', '-')} names {', '.join(map(str, twice))} more than once "
                               f"({','.join(map(str, values))}): give each value once")
        require(len(self.ngram) == 2 and 1 <= self.ngram[0] <= self.ngram[1],
                f"--ngram takes MIN,MAX with 1 <= MIN <= MAX, e.g. 2,5, not {','.join(map(str, self.ngram))}")
        # every arm named, whether or not --prompts runs them: a typo is never skipped silently
        arms = [a.strip() for a in self.arms.split(",") if a.strip()]
        unknown = [a for a in arms if a not in ARMS]
        require(not unknown, f"--arms: unknown arm {', '.join(map(repr, unknown))}; 05 knows "
                             f"{', '.join(ARMS)}" if unknown else "")
        require(bool(arms), f"--arms names no arm; choose from {', '.join(ARMS)}")
        twice = sorted({a for a in arms if arms.count(a) > 1})
        require(not twice, f"--arms names {', '.join(twice)} more than once ({self.arms}): name each arm once")
        urls = self.urls  # a malformed --url is refused before any work
        require(bool(urls) or not self.given("wait_for_server"),
                "--wait-for-server waits for a server given by --base-url or --url, and every arm's server is "
                "started here (--startup-timeout bounds its start): drop --wait-for-server")
        require(not self.k_sweep or "eagle3" in self.arm_list,
                "--k-sweep serves the draft: it needs --prompts and the eagle3 arm in --arms")
        launch = self.given("max_model_len", "server_arg", "startup_timeout", "reasoning_parser")
        online = self.given("num_prompts", "concurrency", "arms", "base_url", "url", "ngram", "max_tokens",
                            "timeout", "wait_for_server") + launch
        require(bool(self.prompts) or not online,
                f"{', '.join(online)} set the online part, which runs only with --prompts: add --prompts or drop them")
        offline = self.given("max_offline_samples", "offline_tokens_per_batch", "offline_dtype", "sampled_repeats")
        require(bool(self.store) or not offline,
                f"{', '.join(offline)} set the offline part, which runs only with --store: add --store or drop them")
        idle = [a for a in urls if a not in arms]
        require(not idle, f"--url/--base-url names a server for arm {', '.join(idle)}, which --arms "
                          f"{self.arms} does not run: add it to --arms or drop the URL" if idle else "")
        # a server is started for each arm without a URL, and for each K of a sweep but the served one
        require(not launch or bool(self.k_sweep) or any(a not in urls for a in arms),
                f"{', '.join(launch)} set the servers 05 starts, and every arm in --arms has a --url: drop "
                f"{'them' if len(launch) > 1 else 'it'}")
        require(self.given("ngram") == [] or "ngram" in arms,
                "--ngram sets the ngram arm, which --arms does not run: add ngram to --arms or drop --ngram")
        record = [a for a in self.server_arg if a.split("=", 1)[0].strip() == RECORD_FLAG]
        require(not record, f"--server-arg {record[0] if record else ''}: 05 starts each speculating server "
                            f"with {RECORD_FLAG} detailed itself (and vLLM refuses it on arm none's): drop this "
                            "--server-arg")

    @property
    def position_edges(self) -> tuple[int, ...]:
        return positions.edges_of_flag(self.position_buckets)

    @property
    def arm_list(self) -> list[str]:
        return [a.strip() for a in self.arms.split(",") if a.strip()] if self.prompts else []

    @property
    def urls(self) -> dict[str, str]:
        """`--url ARM=URL` (repeatable) and `--base-url URL` (= eagle3=URL) -> {arm: url}."""
        urls = {}
        for item in self.url:
            arm, sep, url = item.partition("=")
            require(bool(sep) and arm in ARMS, f"--url {item!r}: expected ARM=URL with ARM one of {', '.join(ARMS)}")
            require(arm not in urls, f"--url names a server for arm {arm} twice ({urls.get(arm)} and {url}): "
                                     "give one")
            check_url(f"--url {arm}=", url)
            urls[arm] = url
        if self.base_url:
            require("eagle3" not in urls, f"--base-url and --url eagle3= both name arm eagle3's server ("
                                          f"{self.base_url} and {urls.get('eagle3')}): give one")
            check_url("--base-url", self.base_url)
            urls["eagle3"] = self.base_url
        return urls

    @property
    def sampling(self) -> dict:
        return {"max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p,
                "seed": self.seed}

    def offline_placement(self) -> tuple[str, str]:
        """(device, dtype name) the offline part runs in: bf16 on a GPU, fp32 on CPU by default."""
        import torch

        device = ("cuda" if torch.cuda.is_available() else "cpu") if self.device == "auto" else self.device
        gpu_default = "bf16" if device.startswith("cuda") else "fp32"
        dtype = self.offline_dtype if self.offline_dtype != "auto" else gpu_default
        return device, dtype

    def model_len(self, longest_prompt: int) -> int:
        """The servers' --max-model-len: room for the longest prompt and --max-tokens, or refused."""
        need = longest_prompt + self.max_tokens
        if self.max_model_len is None:
            return need
        require(self.max_model_len >= need,
                f"--max-model-len {self.max_model_len} is too small: the longest prompt has {longest_prompt} "
                f"tokens and --max-tokens is {self.max_tokens} ({need} needed); raise it or leave it out")
        return self.max_model_len

    @property
    def server_kwargs(self) -> dict:
        """For the servers started here (vllm_server.VllmServer); max_model_len from model_len."""
        return {"max_model_len": self.max_model_len, "startup_timeout": self.startup_timeout,
                "reasoning_parser": None if self.reasoning_parser == "none" else self.reasoning_parser,
                "extra_args": self.server_arg}
