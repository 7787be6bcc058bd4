"""03's coverage report: how much of the supervised target tokens a draft vocabulary of size K
covers, overall and on held-out samples (vocabulary chosen without them), and the curve over K.
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from eagle3_train.common.split import SPLIT
from eagle3_train.common.store import atomic_write_bytes
from eagle3_train.vocab.counts import Counts


def coverage_curve(choose: np.ndarray, evaluate: np.ndarray, sizes: Sequence[int],
                   required: Iterable[int] = ()) -> list[float | None]:
    """Share of `evaluate`'s tokens inside the vocabulary select_vocab(choose, k, required) would
    pick, for each k in sizes; one sort and one cumsum for all sizes."""
    total = int(evaluate.sum())
    if total == 0:
        return [None] * len(sizes)
    req = np.unique(np.asarray(list(required), dtype=np.int64))
    forced = np.zeros(len(choose), dtype=bool)
    forced[req] = True
    order = np.argsort(-np.asarray(choose), kind="stable")
    rest = order[~forced[order]]
    cum = np.concatenate([[0], np.cumsum(evaluate[rest])])
    base = int(evaluate[req].sum())
    return [(base + int(cum[min(k - req.size, rest.size)])) / total if k >= req.size else None
            for k in sizes]


def size_for_coverage(counts: np.ndarray, required: Iterable[int],
                      targets: Sequence[float] = (0.9, 0.95, 0.99, 0.999)) -> dict[str, int | None]:
    """Smallest K whose vocabulary (chosen and measured on `counts`) covers each target share."""
    total = int(counts.sum())
    if total == 0:
        return {str(t): None for t in targets}
    req = np.unique(np.asarray(list(required), dtype=np.int64))
    forced = np.zeros(len(counts), dtype=bool)
    forced[req] = True
    rest = np.sort(counts[~forced])[::-1]
    cov = (int(counts[req].sum()) + np.concatenate([[0], np.cumsum(rest)])) / total
    out = {}
    for t in targets:
        i = int(np.searchsorted(cov, t - 1e-12))
        out[str(t)] = req.size + i if i < cov.size else None
    return out


def default_sizes(vocab_size: int, k: int, n_required: int) -> list[int]:
    """A log-spaced grid over the vocabulary, the usual sizes, and the chosen K."""
    lo = max(n_required, vocab_size // 1024, 1)
    grid = np.unique(np.round(np.geomspace(lo, vocab_size, 11)).astype(int)).tolist()
    usual = [s for s in (4096, 8192, 16384, 32000, 65536) if s <= vocab_size]
    return sorted({*grid, *usual, k})


def coverage_report(counts: Counts, k: int, required: list[dict], sizes: Sequence[int],
                    heldout_fraction: float) -> dict:
    """Coverage of the chosen size overall (vocab and share from the whole set) and on held-out
    samples (vocab chosen on the rest), plus the curve over `sizes`."""
    req_ids = [r["id"] for r in required]
    train = counts.train
    sizes = sorted({k, *(int(s) for s in sizes if len(set(req_ids)) <= s <= counts.vocab_size and s > 0)})
    overall = coverage_curve(counts.total, counts.total, sizes, req_ids)
    held = coverage_curve(train, counts.heldout, sizes, req_ids)
    on_train = coverage_curve(train, train, sizes, req_ids)
    ranks = np.empty(counts.vocab_size, dtype=np.int64)
    ranks[np.argsort(-counts.total, kind="stable")] = np.arange(counts.vocab_size)
    req_out = [{**r, "count": int(counts.total[r["id"]]), "rank_by_count": int(ranks[r["id"]]),
                "chosen_by_count_alone": bool(ranks[r["id"]] < k)} for r in required]
    at_k = dict(zip(sizes, zip(overall, held, on_train)))[k]
    sup_total, sup_held = int(counts.total.sum()), int(counts.heldout.sum())
    return {
        "target_vocab_size": counts.vocab_size,
        "draft_vocab_size": k,
        "coverage": {"overall": at_k[0], "heldout": at_k[1], "train": at_k[2]},
        "samples": {"total": counts.samples, "train": counts.samples - counts.heldout_samples,
                    "heldout": counts.heldout_samples},
        "supervised_tokens": {"total": sup_total, "train": sup_total - sup_held, "heldout": sup_held},
        "distinct_tokens_seen": int(np.count_nonzero(counts.total)),
        "heldout_fraction": heldout_fraction,
        "split": SPLIT,
        "required_tokens": req_out,
        "size_for_coverage": size_for_coverage(counts.total, req_ids),
        "curve": [{"size": s, "overall": o, "heldout": h, "train": t}
                  for s, o, h, t in zip(sizes, overall, held, on_train)],
    }


def plot_coverage(report: dict, path: Path) -> None:
    """coverage.png: share covered against draft vocab size, overall and held-out."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    curve = report["curve"]
    xs = [c["size"] for c in curve]
    ax.plot(xs, [100 * c["overall"] for c in curve], "o-", label="overall (vocab from all samples)")
    held = [(c["size"], 100 * c["heldout"]) for c in curve if c["heldout"] is not None]
    if held:
        ax.plot(*zip(*held), "s--", label="held-out (vocab from the other samples)")
    k, cov = report["draft_vocab_size"], report["coverage"]
    ax.axvline(k, color="gray", lw=0.8)
    label = f"K={k}: {100 * cov['overall']:.2f}%"
    if cov["heldout"] is not None:
        label += f" (held-out {100 * cov['heldout']:.2f}%)"
    ax.annotate(label, (k, 100 * cov["overall"]), textcoords="offset points", xytext=(6, -30),
                fontsize=8, bbox={"boxstyle": "round", "fc": "white", "alpha": 0.8})
    ax.set_xscale("log")
    ax.set_xlabel("draft vocabulary size K")
    ax.set_ylabel("supervised target tokens covered (%)")
    st = report["supervised_tokens"]
    ax.set_title(f"draft vocab coverage: {st['total']:,} supervised tokens, "
                 f"{report['samples']['total']:,} samples, target vocab {report['target_vocab_size']:,}",
                 fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    atomic_write_bytes(path, buf.getvalue())
