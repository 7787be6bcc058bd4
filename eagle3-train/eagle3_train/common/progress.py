"""Progress for people on a terminal (tqdm) and over SSH (`tail -f progress.log`).

The log gets one plain line every `every_s` seconds and at the end:
  2026-11-30T01:02:03Z 01b done 120/1000 (12.0%) errors 3 | 4.10 req/s | 3500 tok/s | eta 0:03:34
"""

from __future__ import annotations

import datetime as _dt
import time
from pathlib import Path

from tqdm.auto import tqdm


def _fmt_eta(seconds: float | None) -> str:
    if seconds is None or seconds != seconds or seconds == float("inf"):
        return "?"
    return str(_dt.timedelta(seconds=int(seconds)))


class Progress:
    def __init__(self, stage: str, total: int, *, initial: int = 0, log_path: Path | None = None,
                 every_s: float = 10.0, unit: str = "it", disable: bool | None = None):
        self.stage = stage
        self.total = total
        self.done = initial
        self.errors = 0
        self.tokens = 0
        self.extra: dict[str, object] = {}
        self._start_done = initial
        self._t0 = time.monotonic()
        self._last_log = 0.0
        self.every_s = every_s
        self.unit = unit
        self.log_path = Path(log_path) if log_path else None
        self.bar = tqdm(total=total, initial=initial, desc=stage, unit=unit, dynamic_ncols=True,
                        disable=disable, smoothing=0.1)
        self._log(force=True, note="start")

    def update(self, n: int = 1, *, errors: int = 0, tokens: int = 0, **extra) -> None:
        self.done += n
        self.errors += errors
        self.tokens += tokens
        self.extra.update(extra)
        self.bar.update(n)
        if extra or errors:
            self.bar.set_postfix(errors=self.errors, **{k: v for k, v in self.extra.items()}, refresh=False)
        self._log()

    def rates(self) -> tuple[float, float, float | None]:
        dt = max(time.monotonic() - self._t0, 1e-9)
        rate = (self.done - self._start_done) / dt
        eta = (self.total - self.done) / rate if rate > 0 else None
        return rate, self.tokens / dt, eta

    def line(self, note: str = "") -> str:
        rate, tok_rate, eta = self.rates()
        pct = 100.0 * self.done / self.total if self.total else 100.0
        now = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        parts = [f"{now} {self.stage} done {self.done}/{self.total} ({pct:.1f}%) errors {self.errors}",
                 f"{rate:.2f} {self.unit}/s", f"{tok_rate:.0f} tok/s", f"eta {_fmt_eta(eta)}"]
        parts += [f"{k} {v}" for k, v in self.extra.items()]
        if note:
            parts.append(note)
        return " | ".join(parts)

    def _log(self, force: bool = False, note: str = "") -> None:
        if self.log_path is None:
            return
        now = time.monotonic()
        if not force and now - self._last_log < self.every_s:
            return
        self._last_log = now
        with open(self.log_path, "a") as f:
            f.write(self.line(note) + "\n")

    def close(self, note: str = "finished") -> None:
        self._log(force=True, note=note)
        self.bar.close()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc):
        self.close("finished" if exc_type is None else f"stopped ({exc_type.__name__})")
