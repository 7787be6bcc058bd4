"""05's report: report.json, report.md (the acceptance and throughput tables) and acceptance.png."""

from __future__ import annotations

from pathlib import Path

from eagle3_train.common.config import EVALUATE
from eagle3_train.common.store import atomic_write_bytes, atomic_write_json, atomic_write_text
from eagle3_train.evaluate.config import ARMS

REPORT_JSON, REPORT_MD, PLOT = "report.json", "report.md", "acceptance.png"


def _fmt(x, nd=2):
    return "-" if x is None else f"{x:.{nd}f}"


def build_report(run: dict, offline: dict | None, arms: dict[str, dict]) -> dict:
    levels = run["online"]["concurrency"] if arms else []
    speedup = {}
    if "none" in arms:
        base = {r["concurrency"]: r["output_tok_s"] for r in arms["none"]["levels"]}
        for arm, res in arms.items():
            if arm != "none":
                speedup[arm] = {r["concurrency"]: (r["output_tok_s"] / base[r["concurrency"]]
                                                   if base.get(r["concurrency"]) else None)
                                for r in res["levels"]}
    return {"stage": EVALUATE, "k": run["k"], "draft": run["draft"]["path"], "target": run["target"]["name_or_path"],
            "offline": offline, "online": {"concurrency": levels, "arms": arms, "speedup_vs_none": speedup},
            "sampling": run["online"].get("sampling") if arms else None}


def render_markdown(rep: dict) -> str:
    lines = [f"# EAGLE-3 draft evaluation (K = {rep['k']})", "",
             f"draft `{rep['draft']}`, target `{rep['target']}`", ""]
    off = rep.get("offline")
    arms = rep["online"]["arms"]
    eagle = arms.get("eagle3", {}).get("spec")
    # Column j: share of drafts whose first j+1 tokens were accepted (vLLM's per-position rate).
    lines += ["| acceptance | AL | " + " | ".join(f">= {i + 1} accepted" for i in range(rep["k"])) + " |",
              "|---|---|" + "---|" * rep["k"]]
    if off:
        which = "held-out " if off.get("heldout") else ""
        lines.append(f"| offline ({off['samples']} {which}samples, {off['drafts']} drafts) | "
                     f"{off['acceptance_length']:.3f} | " + " | ".join(f"{x:.3f}" for x in off["cumulative"]) + " |")
    for arm in ("eagle3", "ngram"):
        s = arms.get(arm, {}).get("spec")
        if s:
            rates = s["per_position_rate"] + [None] * (rep["k"] - len(s["per_position_rate"]))
            lines.append(f"| vLLM {arm} ({s['drafts']} drafts) | {_fmt(s['acceptance_length'], 3)} | "
                         + " | ".join(_fmt(x, 3) for x in rates[:rep["k"]]) + " |")
    lines.append("")
    if arms:
        levels = rep["online"]["concurrency"]
        lines += ["| output tok/s | " + " | ".join(f"c={c}" for c in levels) + " |",
                  "|---|" + "---|" * len(levels)]
        for arm in ARMS:
            if arm in arms:
                row = {r["concurrency"]: r for r in arms[arm]["levels"]}
                cells = []
                for c in levels:
                    r = row.get(c)
                    sp = rep["online"]["speedup_vs_none"].get(arm, {}).get(c)
                    cells.append("-" if r is None else f"{r['output_tok_s']:.1f}"
                                 + (f" ({sp:.2f}x)" if sp else ""))
                lines.append(f"| {arm} | " + " | ".join(cells) + " |")
        lines.append("")
    if off and off.get("al_all_positions") is not None:
        lines.append(f"Offline AL {off['acceptance_length']:.3f} counts drafts where vLLM makes them (after "
                     f"each accepted run and bonus token); a draft at every position would give "
                     f"{off['al_all_positions']:.3f} (al_all_positions).")
    if off and off.get("data_matches_greedy") is not None and off["data_matches_greedy"] < 0.99:
        lines.append(f"Note: only {off['data_matches_greedy']:.1%} of the stored tokens are the target's "
                     "greedy choice (sampled data), so offline acceptance is an estimate.")
    if off and not off.get("heldout", True):
        lines.append(f"Note: offline samples: {off.get('selection')}.")
    if eagle is None and arms:
        lines.append("No eagle3 arm was run.")
    return "\n".join(lines).rstrip() + "\n"


def plot_report(rep: dict, path: Path) -> None:
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    k = rep["k"]
    xs = list(range(1, k + 1))
    series = []
    if rep.get("offline"):
        series.append(("offline (simulated)", rep["offline"]["cumulative"]))
    for arm in ("eagle3", "ngram"):
        s = rep["online"]["arms"].get(arm, {}).get("spec")
        if s and s["per_position_rate"]:
            series.append((f"vLLM {arm}", s["per_position_rate"]))
    width = 0.8 / max(len(series), 1)
    for i, (name, vals) in enumerate(series):
        ax1.bar([x + (i - (len(series) - 1) / 2) * width for x in xs[:len(vals)]], vals[:k], width, label=name)
    # the bars fill the plot from 0 to 1, so the legend sits below it, never over a bar
    ax1.set(xlabel="draft position", ylabel="P(accepted up to here)", ylim=(0, 1),
            title="per-position acceptance")
    ax1.set_xticks(xs)
    if series:
        ax1.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=len(series), fontsize=8, frameon=False)
    for arm, res in rep["online"]["arms"].items():
        pts = sorted((r["concurrency"], r["output_tok_s"]) for r in res["levels"])
        ax2.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=arm)
    ax2.set(xlabel="concurrency", ylabel="output tokens/s", title="throughput in vLLM")
    if rep["online"]["arms"]:
        ax2.set_xscale("log", base=2)
        levels = rep["online"]["concurrency"]
        ax2.set_xticks(levels, [str(c) for c in levels])
        ax2.legend()
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())


def write_report(out: Path, rep: dict) -> str:
    md = render_markdown(rep)
    atomic_write_json(out / REPORT_JSON, rep)
    atomic_write_text(out / REPORT_MD, md)
    plot_report(rep, out / PLOT)
    return md
