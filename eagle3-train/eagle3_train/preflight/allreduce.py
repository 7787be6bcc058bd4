"""The timed all-reduce across all GPUs: torchrun started as a subprocess, its output read as it
comes; once every process has started, the collectives get --allreduce-timeout seconds. Past that
the run counts as hung (the NCCL peer-to-peer hang of some PCIe boxes), and is retried once with
NCCL_P2P_DISABLE=1 to tell whether that is the fix."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from eagle3_train.preflight.allreduce_worker import READY, RESULT
from eagle3_train.preflight.verdict import FAIL, OK, WARN, Verdict

STARTUP_S = 300.0  # torchrun + N processes importing torch and meeting: slow on a loaded box, never a hang
EXIT_S = 120.0  # after the result, for the processes to exit; a result is kept even if they do not
P2P_ENV = "NCCL_P2P_DISABLE"
STAGES_P2P = "02/04/05"  # the stages that run collectives (torchrun, vLLM tensor parallel)


@dataclass
class Outcome:
    status: str  # "ok", "hung" (all started, the collectives never finished), "startup", "error"
    result: dict | None = None
    tail: list[str] = field(default_factory=list)
    p2p_disabled: bool = False


def busbw_gbs(result: dict) -> float:
    """NCCL's bus bandwidth (GB/s): bytes / time per all-reduce x 2(n-1)/n, what a ring moves per link."""
    n = result["world"]
    per_op = result["seconds"] / result["iters"]
    return result["bytes"] / per_op * 2 * (n - 1) / n / 1e9


def parse_output(lines: list[str]) -> tuple[dict[int, int], dict | None]:
    """({rank: pid} of the workers that said ready, rank 0's result) from their interleaved output.
    The workers share one pipe, so one line may hold several ranks' words
    ("...-ready 0 29103...-ready 1 29104"): each is found wherever it sits."""
    ready, result = {}, None
    for line in lines:
        for rank, pid in _READY.findall(line):
            ready[int(rank)] = int(pid)
        for found in _RESULT.findall(line):
            try:
                result = json.loads(found)
            except ValueError:
                pass
    return ready, result


_READY = re.compile(re.escape(READY) + r" (\d+) (\d+)")
_RESULT = re.compile(re.escape(RESULT) + r" (\{[^{}]*\})")


def command(nproc: int, mb: float, iters: int) -> list[str]:
    from eagle3_train.common.vllm_server import free_port

    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
            "-m", "eagle3_train.preflight.allreduce_worker", "--mb", str(mb), "--iters", str(iters)]


def kill(proc: subprocess.Popen, worker_pids, nproc: int) -> None:
    """A hung run, whole: the workers by the pids they reported (torchrun starts each in a session
    of its own, so killing torchrun's would orphan them), then torchrun's session."""
    pids = list(worker_pids)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    if len(pids) < nproc:  # some never reported: torchrun's own shutdown stops them
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def launch(nproc: int, mb: float, iters: int, timeout: float, *, p2p_disabled: bool = False,
           startup: float = STARTUP_S) -> Outcome:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONUNBUFFERED": "1"}
    if p2p_disabled:
        env[P2P_ENV] = "1"
    lines: list[str] = []
    changed = threading.Condition()
    # its own session, so a hung run is killed whole: torchrun and every worker
    proc = subprocess.Popen(command(nproc, mb, iters), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env, start_new_session=True)

    def read():
        for line in proc.stdout:
            with changed:
                lines.append(line.rstrip("\n"))
                changed.notify_all()
        with changed:
            changed.notify_all()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()

    def wait_until(pred, seconds: float) -> bool:
        end = time.monotonic() + seconds
        with changed:
            while not pred():
                left = end - time.monotonic()
                if left <= 0:
                    return False
                changed.wait(min(left, 1.0))
        return True

    started = wait_until(lambda: len(parse_output(lines)[0]) >= nproc or proc.poll() is not None, startup)
    # the clock stops at rank 0's result, not at torchrun's exit: tearing down N processes is not the collective
    finished = started and wait_until(lambda: parse_output(lines)[1] is not None or proc.poll() is not None, timeout)
    if finished:
        try:
            proc.wait(timeout=EXIT_S)
        except subprocess.TimeoutExpired:
            finished = parse_output(lines)[1] is not None
            kill(proc, parse_output(lines)[0].values(), nproc)
    else:
        kill(proc, parse_output(lines)[0].values(), nproc)
    proc.wait()
    reader.join(timeout=10)
    ready, result = parse_output(lines)
    tail = [ln for ln in lines if READY not in ln and RESULT not in ln][-5:]
    if not started:
        return Outcome("startup", None, tail, p2p_disabled)
    if not finished:
        return Outcome("hung", None, tail, p2p_disabled)
    if result is None:
        return Outcome("error", result, tail or [f"torchrun exited {proc.returncode}"], p2p_disabled)
    return Outcome("ok", result, tail, p2p_disabled)


def measured(result: dict) -> str:
    return (f"{result['iters']} x {result['bytes'] / 1e6:,.0f} MB over {result['world']} processes "
            f"({result['backend']}): bus bandwidth {busbw_gbs(result):,.1f} GB/s")


def allreduce_verdict(n: int, first: Outcome, retry: Outcome | None, *, timeout: float,
                      min_busbw: float = 0.0, unit: str = "GPUs") -> Verdict:
    name = "all-reduce"
    if first.status == "ok":
        r = first.result
        if not r.get("correct", False):
            return Verdict(name, FAIL, f"{measured(r)}, but the sums came back wrong",
                           f"rerun with {P2P_ENV}=1; if still wrong, the box's GPUs or driver are at fault")
        if r["backend"] == "nccl" and busbw_gbs(r) < min_busbw:
            return Verdict(name, WARN, f"{measured(r)}, below {min_busbw:g} GB/s",
                           "check `nvidia-smi topo -m` and the PCIe links (x16, Gen5?)")
        p2p = f"; {P2P_ENV}=1 is set" if first.p2p_disabled else ""
        return Verdict(name, OK, measured(r) + p2p)
    if first.status == "startup":
        return Verdict(name, FAIL, f"the {n} processes did not all start within {STARTUP_S:.0f} s: "
                                   f"{' | '.join(first.tail) or 'no output'}", "run the worker by hand: "
                       f"python -m torch.distributed.run --nproc-per-node {n} -m "
                       "eagle3_train.preflight.allreduce_worker --mb 1 --iters 1")
    if first.status == "error":
        return Verdict(name, FAIL, f"across {n} {unit} it failed: {' | '.join(first.tail)[-400:]}",
                       "read the error above; NCCL_DEBUG=INFO says more")
    hung = f"hung across {n} {unit} (NCCL peer-to-peer?): no result {timeout:g} s after every process started"
    if first.p2p_disabled:
        return Verdict(name, FAIL, f"{hung}, with {P2P_ENV}=1 already set",
                       "not the P2P hang: NCCL_DEBUG=INFO shows where it stops; check the driver and the PCIe/IOMMU "
                       "settings (ACS)")
    if retry is not None and retry.status == "ok" and retry.result.get("correct", False):
        return Verdict(name, FAIL, f"{hung}; with {P2P_ENV}=1 it ran: {measured(retry.result)}",
                       f"export {P2P_ENV}=1 for {STAGES_P2P} and rerun this preflight")
    still = "also hung" if retry is not None and retry.status == "hung" else \
        f"did not run either ({retry.status})" if retry is not None else "was not tried"
    return Verdict(name, FAIL, f"{hung}; with {P2P_ENV}=1 it {still}",
                   f"rerun with {P2P_ENV}=1, and export it for {STAGES_P2P}; if it still hangs, NCCL_DEBUG=INFO "
                   "shows where it stops")


def run_allreduce(n: int, mb: float, iters: int, timeout: float, *, min_busbw: float = 0.0,
                  unit: str = "GPUs") -> Verdict:
    """Launch, and on a hang retry once with NCCL_P2P_DISABLE=1 (unless it is already set)."""
    disabled = os.environ.get(P2P_ENV) == "1"
    first = launch(n, mb, iters, timeout, p2p_disabled=disabled)
    retry = None
    if first.status == "hung" and not disabled:
        retry = launch(n, mb, iters, timeout, p2p_disabled=True)
    return allreduce_verdict(n, first, retry, timeout=timeout, min_busbw=min_busbw, unit=unit)
