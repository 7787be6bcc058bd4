"""Running a stage: as a subprocess (its environment, its command line) or in this process exactly
as its script runs it (errors.run_main around main()), its exit code and output captured."""
from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from helpers import REPO, script_path, stage_cli


def stage_env(**extra: str) -> dict:
    """The environment of a stage subprocess: offline, no bars, one thread. Bytecode is cached
    under .cache/pycache even where PYTHONDONTWRITEBYTECODE is set: without it every start of a
    stage recompiles torch and transformers (~20 s of a loaded 2-core machine per run)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TQDM_DISABLE": "1",
                "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
                "PYTHONPYCACHEPREFIX": str(REPO / ".cache" / "pycache")})
    env.update(extra)
    return env


def stage_cmd(script: str, argv: Iterable[str]) -> list[str]:
    """A numbered stage by name (`03_build_vocab_mapping`), or any script by absolute path."""
    path = Path(script) if Path(script).is_absolute() else script_path(script)
    return [sys.executable, str(path), *map(str, argv)]


@dataclass
class Result:
    rc: int
    stdout: str
    stderr: str

    def error_lines(self) -> list[str]:
        return [ln for ln in self.stderr.splitlines() if ln.startswith("error:")]


def run_stage(cmd: list[str], *, timeout: float = 600, env: dict | None = None,
              preexec_fn=None) -> Result:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env or stage_env(),
                       preexec_fn=preexec_fn)
    return Result(p.returncode, p.stdout, p.stderr)


def run_inprocess(script: str, argv, capfd) -> Result:
    """A stage run in this process exactly as its script runs it (errors.run_main around main()),
    its output captured; an exception that escapes run_main (a traceback for a user) comes back
    as exit 1 with `Traceback` in stderr, so assert_one_error_line reports it."""
    from eagle3_train.common.errors import run_main

    capfd.readouterr()
    try:
        rc = run_main(stage_cli(script).main, [str(a) for a in argv])
    except SystemExit as e:  # argparse
        rc = e.code if isinstance(e.code, int) else 2
    except BaseException as e:  # noqa: BLE001
        out, err = capfd.readouterr()
        return Result(1, out, f"{err}Traceback (escaped run_main): {type(e).__name__}: {e}")
    out, err = capfd.readouterr()
    return Result(rc, out, err)
