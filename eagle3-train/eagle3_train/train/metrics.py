"""04's metrics: sums over a log interval (checkpointed, so a resumed run logs what the
uninterrupted one did), metrics.jsonl read back by kind, and the training curves."""

from __future__ import annotations

import io
import time
from pathlib import Path

import torch

from eagle3_train.common import positions
from eagle3_train.common.acceptance import empty, flatten, merge, summarize, unflatten
from eagle3_train.common.progress import Progress
from eagle3_train.common.store import JsonlWriter, atomic_write_bytes, read_jsonl
from eagle3_train.train.config import METRICS, POSITIONS_PLOT


class Meter:
    """Sums over a log interval (or a validation pass); plain numbers so they can be checkpointed."""

    def __init__(self, steps: int, state: dict | None = None, edges: tuple[int, ...] | None = None):
        self.steps = steps
        self.edges = edges  # validation's: its acceptance is counted by position too (the chain's by_position)
        self.s = state or {"loss": 0.0, "n": 0, "loss_sum": [0.0] * steps, "loss_cnt": [0.0] * steps,
                           "tokens": 0, "chain": None, "grad_norm": 0.0}

    def add(self, loss: float, metrics: dict, grad_norm: float = 0.0) -> None:
        """One step (or validation batch): its mean loss, the objective's metrics (see
        objective.batch_metrics) and the gradient norm."""
        s = self.s
        s["loss"] += loss
        s["n"] += 1
        s["loss_sum"] = [a + b for a, b in zip(s["loss_sum"], metrics["loss_sum"].tolist())]
        s["loss_cnt"] = [a + b for a, b in zip(s["loss_cnt"], metrics["loss_cnt"].tolist())]
        s["tokens"] += metrics["tokens"]
        s["chain"] = metrics["chain"] if s["chain"] is None else merge([s["chain"], metrics["chain"]])
        s["grad_norm"] += grad_norm

    def reduce(self, d) -> dict:
        """Sums over ranks (every rank must call it)."""
        s = self.s
        chain = merge([s["chain"] or empty(self.steps)])
        flat = [s["loss"], s["n"], s["tokens"], s["grad_norm"], *s["loss_sum"], *s["loss_cnt"], *flatten(chain)]
        n_flat = len(flat)
        if self.edges is not None:  # a rank without batches adds zeros of the same length
            flat += positions.flatten((s["chain"] or {}).get("by_position") or positions.empty(self.steps, self.edges))
        t = d.sum(torch.tensor(flat, dtype=torch.float64, device=d.device)).tolist()
        k = self.steps
        loss, n, tokens, gn = t[:4]
        ls, lc = t[4:4 + k], t[4 + k:4 + 2 * k]
        rates = summarize(unflatten(t[4 + 2 * k:n_flat], k))
        by_position = {} if self.edges is None else {
            "by_position": positions.block(positions.unflatten(t[n_flat:], k, self.edges))}
        # acceptance_length / acc_cum / al_by_depth: vLLM's walk (what it would report);
        # al_all_positions: a draft at every supervised position (higher when acceptance is bursty).
        return {"loss": loss / max(n, 1), "loss_by_step": [a / b if b else None for a, b in zip(ls, lc)],
                "acc_cond": rates["conditional"], "acc_cum": rates["cumulative"],
                "acceptance_length": rates["acceptance_length"], "al_by_depth": rates["al_by_depth"],
                "al_all_positions": rates["al_all_positions"], "acc_cum_all_positions": rates["cumulative_all_positions"],
                "drafts": rates["drafts"], "tokens": int(tokens), "grad_norm": gn / max(n, 1), **by_position}


class Recorder:
    """Where a run's numbers go: metrics.jsonl records (train / val / checkpoint / resume; the last
    record of a kind and step wins, so steps redone after a resume are logged again), the progress
    bar and progress.log. Only rank 0 writes; every call is safe on every rank."""

    def __init__(self, run_dir: Path, main: bool, progress: Progress):
        self.log = JsonlWriter(Path(run_dir) / METRICS) if main else None
        self.progress = progress
        self.restart_clock()

    def restart_clock(self) -> None:
        """Throughput counts training only: the clock restarts after logging and checkpointing."""
        self.since, self.cpu_since = time.monotonic(), time.process_time()

    def write(self, record: dict) -> None:
        if self.log:
            self.log.write(record)

    def step(self, loss: float, lr: float, tokens: int) -> None:
        self.progress.update(1, tokens=tokens, loss=f"{loss:.4f}", lr=f"{lr:.2e}")

    def train(self, step: int, epoch: int, lr: float, totals: dict) -> None:
        """One train record from a log interval's totals (Meter.reduce)."""
        tokens_per_s = totals["tokens"] / max(time.monotonic() - self.since, 1e-9)
        self.write({"kind": "train", "step": step, "epoch": epoch, "lr": lr,
                    **{k: totals[k] for k in ("loss", "loss_by_step", "acc_cond", "acc_cum",
                                              "acceptance_length", "al_all_positions", "tokens", "grad_norm")},
                    "tokens_per_s": tokens_per_s, "cpu_s": time.process_time() - self.cpu_since,
                    "time": time.time()})
        if self.log:
            self.progress.update(0, al=f"{totals['acceptance_length']:.2f}",
                                 acc0=f"{totals['acc_cum'][0]:.2f}", tok_s=f"{tokens_per_s:.0f}")
        self.restart_clock()

    def checkpoint(self, step: int, path: Path, val: dict | None) -> None:
        if val is not None:
            self.write({"kind": "val", "step": step, **val, "time": time.time()})
            if self.log:
                self.progress.update(0, val_al=f"{val['acceptance_length']:.2f}")
        self.write({"kind": "checkpoint", "step": step, "path": str(path), "time": time.time()})
        self.restart_clock()

    def close(self, note: str) -> None:
        self.progress.close(note)
        if self.log:
            self.log.close()


def read_metrics(run_dir: Path) -> dict[str, list[dict]]:
    """metrics.jsonl by kind, one record per step (the last one written wins)."""
    out: dict[str, dict[int, dict]] = {}
    for rec in read_jsonl(Path(run_dir) / METRICS):
        out.setdefault(rec.get("kind", "?"), {})[rec.get("step", -1)] = rec
    return {k: [v[s] for s in sorted(v)] for k, v in out.items()}


def validation_series(val: list[dict], k: int) -> list[tuple[str, str, list]]:
    """(label, style, values) of the validation AL plot: vLLM's count with k draft tokens, with 3
    when k > 3 (a common serving setting), and the every-position average for comparison."""
    out = [(f"AL, {k} tokens (vLLM's count)", "o-", [r["acceptance_length"] for r in val])]
    if k > 3:
        out.append(("AL, 3 tokens (vLLM's count)", "s--", [(r.get("al_by_depth") or [None] * 3)[2] for r in val]))
    out.append((f"AL, {k} tokens, a draft at every position", ":", [r.get("al_all_positions") for r in val]))
    return out


LOSS_NAMES = {"kl": "forward KL", "ce": "cross-entropy on the target's greedy token"}


def plot_curves(run_dir: Path, loss: str) -> Path | None:
    """curves.png: the train loss per TTT step (`loss`: 04's --loss), accuracy per position,
    validation AL and the lr."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    m = read_metrics(run_dir)
    train, val = m.get("train", []), m.get("val", [])
    if not train:
        return None
    fig = Figure(figsize=(11, 7.5), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 2)
    steps = [r["step"] for r in train]
    k = len(train[0]["loss_by_step"])
    for i in range(k):
        axes[0, 0].plot(steps, [r["loss_by_step"][i] for r in train], label=f"TTT step {i}", lw=1)
    axes[0, 0].set_title(f"train loss ({LOSS_NAMES.get(loss, loss)}) per TTT step", fontsize=10)
    axes[0, 0].set_yscale("log")
    axes[0, 0].legend(fontsize=7)
    for i in range(k):
        axes[0, 1].plot(steps, [r["acc_cum"][i] for r in train], label=f"pos {i}", lw=1)
    axes[0, 1].set_title("train cumulative accuracy per draft position")
    axes[0, 1].legend(fontsize=7)
    if val:
        vs = [r["step"] for r in val]
        for label, style, ys in validation_series(val, k):
            axes[1, 0].plot(vs, ys, style, label=label)
        axes[1, 0].legend(fontsize=7)
    axes[1, 0].set_title("validation: estimated acceptance length")
    axes[1, 1].plot(steps, [r["lr"] for r in train])
    axes[1, 1].set_title("learning rate")
    for ax in axes.flat:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    path = Path(run_dir) / "curves.png"
    atomic_write_bytes(path, buf.getvalue())
    return path


def last_by_position(run_dir: Path) -> dict | None:
    """The last validation record that counted acceptance by position (step, AL, by_position)."""
    val = [r for r in read_metrics(run_dir).get("val", []) if r.get("by_position")]
    return val[-1] if val else None


def plot_positions(run_dir: Path) -> Path | None:
    """al_by_position.png: the last validation's acceptance length by where its drafts stand (the
    first drafted token's position in prompt + answer), each bar with its drafts; a bucket with
    fewer than positions.MIN_DRAFTS drafts is grey (too few to compare)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    last = last_by_position(run_dir)
    if last is None:
        return None
    rows = last["by_position"]["rows"]
    k = last["by_position"]["counts"]["k"]
    fig = Figure(figsize=(7, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    xs = list(range(len(rows)))
    als = [r["acceptance_length"] or 0.0 for r in rows]
    ax.bar(xs, als, color=["lightgrey" if r["few"] else "C0" for r in rows])
    for x, r, al in zip(xs, rows, als):
        ax.annotate(f"{r['drafts']:,} drafts" if r["drafts"] else "no drafts", (x, al), ha="center",
                    va="bottom", fontsize=7)
    ax.axhline(last["acceptance_length"], ls="--", color="grey", lw=1,
               label=f"every bucket together {last['acceptance_length']:.3f}")
    ax.set_xticks(xs, [r["bucket"] for r in rows])
    ax.set_xlabel("position of the draft's first token (prompt + answer)")
    ax.set_ylabel(f"acceptance length, {k} tokens")
    ax.set_title(f"validation at step {last['step']}: acceptance length by position", fontsize=10)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    path = Path(run_dir) / POSITIONS_PLOT
    atomic_write_bytes(path, buf.getvalue())
    return path
