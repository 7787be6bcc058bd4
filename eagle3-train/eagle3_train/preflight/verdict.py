"""A check's verdict and the report built from them: one line per check, JSON for --json/--out."""

from __future__ import annotations

from dataclasses import asdict, dataclass

OK, WARN, FAIL, SKIPPED = "ok", "warn", "fail", "skipped"
STATUSES = (OK, WARN, FAIL, SKIPPED)
NO_CUDA = "no CUDA device"  # the detail of every GPU check skipped on a machine without one


@dataclass(frozen=True)
class Verdict:
    name: str
    status: str  # one of STATUSES
    detail: str
    advice: str = ""  # what to do; empty when there is nothing to do

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"status {self.status!r} is not one of {STATUSES}")

    def line(self) -> str:
        """`fail     all-reduce: ... (what to do)`: status padded so the names line up."""
        advice = f" ({self.advice})" if self.advice else ""
        return f"{self.status:<8} {self.name}: {self.detail}{advice}"

    def to_dict(self) -> dict:
        return asdict(self)


def skipped(name: str, why: str = NO_CUDA) -> Verdict:
    return Verdict(name, SKIPPED, why)


def summary(verdicts: list[Verdict]) -> str:
    counts = {s: sum(v.status == s for v in verdicts) for s in STATUSES}
    return "00_preflight: " + ", ".join(f"{n} {s}" for s, n in counts.items())


def exit_code(verdicts: list[Verdict]) -> int:
    """1 when a check failed (the box is not ready), else 0. Exit 2 stays what it is in every stage:
    bad input (a flag, an unreadable --plan), raised before any check runs."""
    return 1 if any(v.status == FAIL for v in verdicts) else 0


def report(verdicts: list[Verdict]) -> dict:
    return {"checks": [v.to_dict() for v in verdicts], "exit_code": exit_code(verdicts),
            "summary": summary(verdicts)}
