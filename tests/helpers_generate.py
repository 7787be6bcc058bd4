"""Helpers for the 01b tests: the fault-injecting server as a subprocess, and running 01b."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from helpers import REPO, script_path

FAULT_SERVER = REPO / "tests" / "fault_server.py"
GEN = script_path("01b_generate_synthetic")
TOKENIZE = script_path("01c_tokenize")


class FaultServer:
    """`with FaultServer(tmp_path, "--schedule", "500,ok") as fs: fs.url` (a real process)."""

    def __init__(self, workdir: Path, *args: str, port: int | None = None, model: str = "fake"):
        from eagle3_train.common.vllm_server import free_port

        self.workdir = Path(workdir)
        self.args = list(args)
        self.port = port or free_port()
        self.model = model
        self.log = self.workdir / f"fault-{self.port}.requests.jsonl"
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self, *extra: str, timeout: float = 90, ready: bool = True) -> FaultServer:
        """`ready=False`: return once the process runs (with --start-after / --loading it is not up yet)."""
        cmd = [sys.executable, str(FAULT_SERVER), "--port", str(self.port), "--model", self.model,
               "--log", str(self.log), *self.args, *extra]
        out = open(self.workdir / f"fault-{self.port}.out", "ab")
        self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        out.close()
        if not ready:
            return self
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"fault server exited with {self.proc.returncode}: {cmd}")
            try:
                with urllib.request.urlopen(self.url + "/models", timeout=1):
                    return self
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError("fault server did not start")

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    def requests(self) -> list[dict]:
        """The chat requests it answered, with their behaviour (not the paths log)."""
        return [r for r in self._logged() if "path" not in r]

    def paths(self) -> list[dict]:
        """Every request it got, in order: {method, path, loading}."""
        return [r for r in self._logged() if "path" in r]

    def gets(self, path: str | None = None) -> list[dict]:
        """The GETs it got (of `path` only, if given): /v1/models, /health, /metrics."""
        return [r for r in self.paths() if r["method"] == "GET" and path in (None, r["path"])]

    def _logged(self) -> list[dict]:
        if not self.log.exists():
            return []
        return [json.loads(line) for line in self.log.read_text().splitlines() if line.strip()]

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def env() -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TQDM_DISABLE": "1",
            "PYTHONUNBUFFERED": "1"}


def gen_cmd(prompts: Path, out: Path, urls: list[str] | str, *extra: str, model: str = "fake") -> list[str]:
    urls = [urls] if isinstance(urls, str) else urls
    cmd = [sys.executable, str(GEN), "--input", str(prompts), "--output-dir", str(out), "--model", model]
    for u in urls:
        cmd += ["--base-url", u]
    return cmd + list(extra)


def run_gen(prompts: Path, out: Path, urls, *extra: str, model: str = "fake", timeout: float = 300):
    return subprocess.run(gen_cmd(prompts, out, urls, *extra, model=model), capture_output=True, text=True,
                          env=env(), timeout=timeout)


def write_prompts(path: Path, texts: list[str], ids: list[str] | None = None) -> Path:
    with open(path, "w") as f:
        for i, t in enumerate(texts):
            f.write(json.dumps({"id": ids[i] if ids else f"q{i:03d}", "messages": [
                {"role": "user", "content": t}, {"role": "assistant", "content": "old answer"}]}) + "\n")
    return path


def read_records(path: Path) -> list[dict]:
    """Every line must parse: a torn line here is a failure, not something to skip."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]
