#!/usr/bin/env python3
"""Which draft serves faster: EAGLE-3 against DFlash, by output tok/s modelled from forward times.

    uv run python scripts/bench/arch.py                          # the measured figures (docs/measurements.md)
    uv run python scripts/bench/arch.py --family kimi --report mla=R1/report.json --report dflash=R2/report.json
    uv run python scripts/bench/arch.py --family dense --arm "e3:eagle3=.98,.96,.93" --arm "df:dflash=.96,.92,.87"
    uv run python scripts/bench/arch.py --tables measured.json   # measured forward times instead of the model

AL alone does not decide: an EAGLE-3 step runs K draft forwards in a row, a DFlash step one, and the
target verifies 1 + K tokens a sequence either way. common/serving_rate.py turns per-position
acceptance rates and forward times into output tok/s at each K and concurrency; plan/forward.py
models the forward times of the user's box (8x RTX PRO 6000, TP 8) for a target family:

  kimi   Kimi-K2.5 INT4 (docs/kimi-k2.5-text-config.json), EAGLE-3 = the MLA draft layer (04's auto)
  dense  a Llama-3.3-70B-shaped dense target, bf16, on the same box, EAGLE-3 = the Llama layer

Arms: --report NAME=PATH (05's report.json: its K sweep's per-position rates at each K, else the
evaluated K's; the draft's method says the arch), --arm NAME:ARCH=p1,p2,... (cumulative rates), or
none: the measured groups of docs/measurements.md, each target in its family. For a K below the
largest measured, the rates are the first K positions, scaled to the AL measured at that K where
one was. --tables FILE: {"target": T, "eagle3": T, "dflash": T}, each T {"points": [[tokens, ms],
...], "kv_ms": ms, "kv_per": "seq"|"row"} (measured forward times of --family's target and drafts,
e.g. on the box); missing keys stay modelled. Prints per arm, K and concurrency the modelled output
tok/s and the speed-up over no drafting, and which arch and K win. Runs in a second, on the CPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from eagle3_train.common import serving_rate as R
from eagle3_train.common.errors import PipelineError, run_main
from eagle3_train.plan import forward as F

REPO = Path(__file__).resolve().parents[2]
KIMI_CONFIG = REPO / "docs" / "kimi-k2.5-text-config.json"
# Llama-3.3-70B's public config.json: the dense family's target.
DENSE = {"_name": "Llama-3.3-70B-shaped (bf16)", "model_type": "llama", "num_hidden_layers": 80,
         "hidden_size": 8192, "vocab_size": 128256, "num_attention_heads": 64, "num_key_value_heads": 8,
         "head_dim": 128, "intermediate_size": 28672}
FAMILIES = {"kimi": "Kimi-K2.5 INT4 on 8x RTX PRO 6000, TP 8", "dense": "a Llama-3.3-70B-shaped dense target, bf16, "
            "on the same box, TP 8"}
EAGLE3_LAYER = {"kimi": "mla", "dense": "llama"}  # 04's --draft-arch auto for the family

# docs/measurements.md, "The draft for the k users serve": vLLM's per-position rates at K = 7
# (cumulative), and the AL measured at K = 3 (the Kimi twin: 05's offline walk).
MEASURED = (
    ("Llama bench target (assets/bench-reasoner), vLLM", "dense", (
        ("eagle3 llama layer, defaults, 500 steps", "eagle3", (.98, .96, .93, .91, .89, .88, .86), {3: 3.893}),
        ("dflash block 8, 1 layer", "dflash", (.96, .92, .87, .83, .80, .78, .75), {3: 3.810}))),
    ("DeepSeek-V3 bench target, vLLM", "kimi", (
        ("eagle3 MLA layer (auto)", "eagle3", (.86, .76, .70, .49, .28, .15, .07), {3: 3.339}),
        ("dflash block 8, 1 layer", "dflash", (.93, .87, .83, .80, .77, .75, .72), {3: 3.749}))),
    ("Kimi-K2.5 twin, 05 offline walk", "kimi", (
        ("eagle3 MLA layer (auto)", "eagle3", (.97, .92, .89, .84, .68, .53, .42), {3: 3.769}),
        ("dflash block 8, 1 layer", "dflash", (.87, .71, .65, .61, .58, .55, .53), {3: 3.453}))),
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # what drafts
    p.add_argument("--report", action="append", default=[], metavar="NAME=PATH",
                   help="an arm from 05's report.json (repeatable)")
    p.add_argument("--arm", action="append", default=[], metavar="NAME:ARCH=p1,p2,...",
                   help="an arm from cumulative per-position rates; ARCH eagle3 or dflash (repeatable)")
    p.add_argument("--family", choices=sorted(FAMILIES), default="kimi",
                   help="the target family of --report/--arm arms (default: kimi)")
    # the serving
    p.add_argument("--concurrency", default="1,8,32,64", help="sequences in flight (default: 1,8,32,64)")
    p.add_argument("--ks", default="1,2,3,4,5,6,7", help="K values to model, each up to an arm's measured "
                   "positions (default: 1-7)")
    p.add_argument("--context", type=int, default=4096, help="tokens in each sequence's KV cache (default: 4096)")
    p.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto",
                   help="the target's KV cache: auto = bf16 (default), fp8")
    p.add_argument("--dflash-layers", type=int, default=1, help="DFlash draft depth costed (default: 1, "
                   "as the measured drafts)")
    p.add_argument("--tables", type=Path, default=None, help="measured forward times of --family's target and "
                   "drafts (JSON; see above)")
    p.add_argument("--json", type=Path, default=None, help="also write every modelled row here")
    return p.parse_args(argv)


def ints(text: str, flag: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        raise PipelineError(f"{flag} {text!r}: give positive integers separated by commas, e.g. 1,8,32,64")
    return sorted(set(out))


def arm(name: str, arch: str, rates_by_k: dict, al_by_k: dict | None = None) -> dict:
    if arch not in R.ARCHS:
        raise PipelineError(f"arm {name}: arch must be one of {', '.join(R.ARCHS)}, not {arch!r}")
    for k, rates in rates_by_k.items():
        R.expected_accepted(rates, len(rates), f"arm {name} at K = {k}")
    return {"name": name, "arch": arch, "rates_by_k": rates_by_k, "al_by_k": al_by_k or {}}


def parse_arm(text: str) -> dict:
    head, sep, rates = text.partition("=")
    name, _, arch = head.partition(":")
    try:
        values = [float(x) for x in rates.split(",")]
    except ValueError:
        values = []
    if not sep or not name or not values:
        raise PipelineError(f"--arm {text!r}: write NAME:ARCH=p1,p2,... (cumulative per-position rates)")
    return arm(name, arch, {len(values): values})


def read_report(text: str) -> dict:
    """An arm from 05's report.json: the K sweep's vLLM rates per K, else the evaluated K's (vLLM's,
    else the offline walk's cumulative rates)."""
    name, sep, path = text.partition("=")
    if not sep or not name:
        raise PipelineError(f"--report {text!r}: write NAME=PATH (05's report.json)")
    try:
        rep = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise PipelineError(f"--report {path}: no such file (05 writes <output-dir>/report.json)") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PipelineError(f"--report {path}: not JSON ({e})") from None
    if not isinstance(rep, dict) or "k" not in rep:
        raise PipelineError(f"--report {path}: not 05's report.json (no k)")
    rates = {}
    for row in (rep.get("k_sweep") or {}).get("by_k") or []:
        if row.get("per_position_rate"):
            rates[int(row["k"])] = row["per_position_rate"]
    spec = (((rep.get("online") or {}).get("arms") or {}).get("eagle3") or {}).get("spec") or {}
    if not rates and spec.get("per_position_rate"):
        rates[int(rep["k"])] = spec["per_position_rate"]
    if not rates and (rep.get("offline") or {}).get("cumulative"):
        rates[int(rep["k"])] = rep["offline"]["cumulative"]
    if not rates:
        raise PipelineError(f"--report {path}: no per-position rates (run 05 with an eagle3 arm, --k-sweep or --store)")
    return arm(name, "dflash" if rep.get("method") == "dflash" else "eagle3", rates)


def rates_at(a: dict, k: int) -> list[float] | None:
    """The arm's rates at K: measured at K, else the first K of the smallest K measured above it,
    scaled to the AL measured at K where there is one; None above every measured K."""
    if k in a["rates_by_k"]:
        return list(a["rates_by_k"][k])
    above = [kk for kk in sorted(a["rates_by_k"]) if kk > k]
    if not above:
        return None
    head = list(a["rates_by_k"][above[0]][:k])
    al = a["al_by_k"].get(k)
    if al is not None and sum(head) > 0:
        head = [min(1.0, p * (al - 1) / sum(head)) for p in head]
    return head


def load_tables(path: Path | None) -> dict:
    if path is None:
        return {}
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise PipelineError(f"--tables {path}: no such file") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PipelineError(f"--tables {path}: not JSON ({e})") from None
    if not isinstance(data, dict) or not set(data) & {"target", "eagle3", "dflash"}:
        raise PipelineError(f"--tables {path}: give {{\"target\": T, \"eagle3\": T, \"dflash\": T}}, "
                            "each T {\"points\": [[tokens, ms], ...], \"kv_ms\": ms, \"kv_per\": \"seq\"}")
    out = {}
    for key in ("target", "eagle3", "dflash"):
        t = data.get(key)
        if t is None:
            continue
        if not isinstance(t, dict):
            raise PipelineError(f"--tables {path}: {key} must be an object with points")
        out[key] = R.forward(t.get("points") or [], f"--tables {path}: {key}", kv_ms=t.get("kv_ms", 0.0),
                             kv_per=t.get("kv_per", "seq"), source=f"measured: {path} ({key})")
    return out


def forwards(family: str, args, box: F.Box, kimi: dict, tables: dict) -> dict:
    cfg = kimi if family == "kimi" else DENSE
    fam_box = replace(box, kv_dtype_bytes=1 if args.kv_cache_dtype == "fp8" else 2,
                      routing_share=box.routing_share if family == "kimi" else 1.0)
    out = {"target": F.target_forward(cfg, fam_box, args.context),
           "eagle3": F.draft_forward(cfg, fam_box, EAGLE3_LAYER[family], args.context),
           "dflash": F.draft_forward(cfg, fam_box, "dflash", args.context, layers=args.dflash_layers)}
    return out | (tables if family == args.family else {})  # measured on one box, for one target


def model(arms: list[dict], fw: dict, ks: list[int], levels: list[int]) -> list[dict]:
    rows = []
    for a in arms:
        for k in ks:
            rates = rates_at(a, k)
            if rates is None:
                continue
            for c in levels:
                r = R.serve_rate(a["arch"], rates, k, c, fw["target"], fw[a["arch"]])
                if a["arch"] == "eagle3":  # the AL share a DFlash draft needs to serve as fast
                    r["dflash_break_even"] = R.serve_rate("dflash", rates, k, c, fw["target"], fw["dflash"])[
                        "step_ms"] / r["step_ms"]
                rows.append(r | {"arm": a["name"]})
    return rows


def render(title: str, rows: list[dict], levels: list[int], fw: dict) -> list[str]:
    lines = [f"## {title}", "", "forward times: " + "; ".join(
        f"{key} {f.source}: {f.ms(1, 1):.2f} ms at 1 token, {f.ms(64, 8):.2f} at 64 over 8 sequences"
        for key, f in fw.items()), "",
        "| arm | K | AL | " + " | ".join(f"c={c} tok/s (x none)" for c in levels) + " |",
        "|---|---|---|" + "---|" * len(levels)]
    names = list(dict.fromkeys(r["arm"] for r in rows))
    for name in names:
        for k in sorted({r["k"] for r in rows if r["arm"] == name}):
            cells = {r["concurrency"]: r for r in rows if r["arm"] == name and r["k"] == k}
            al = next(iter(cells.values()))["acceptance_length"]
            lines.append(f"| {name} | {k} | {al:.2f} | " + " | ".join(
                f"{cells[c]['tok_s']:,.0f} ({cells[c]['speedup']:.2f}x)" for c in levels) + " |")
    lines.append("")
    for c in levels:
        at = [r for r in rows if r["concurrency"] == c]
        win = R.best(at)
        per_arch = {a: R.best([r for r in at if r["arch"] == a]) for a in R.ARCHS if any(r["arch"] == a for r in at)}
        other = [f"best {a}: {r['arm']} K={r['k']} {r['tok_s']:,.0f} tok/s "
                 f"({r['tok_s'] / win['tok_s']:.2f} of the best)" for a, r in per_arch.items() if a != win["arch"]]
        lines.append(f"c={c}: **{win['arch']}** wins, {win['arm']} at K={win['k']}: {win['tok_s']:,.0f} tok/s, "
                     f"{win['speedup']:.2f}x no drafting (step {win['verify_ms']:.1f} ms verify + "
                     f"{win['draft_ms']:.2f} ms draft)" + ("; " + "; ".join(other) if other else ""))
    kmax = max((r["k"] for r in rows), default=0)
    first = next((r["arm"] for r in rows if "dflash_break_even" in r), None)
    even = [r for r in rows if r["k"] == kmax and r["arm"] == first]
    if even:
        lines.append(f"At K={kmax} a DFlash draft serves as fast as {even[0]['arm']} with this share of its AL: "
                     + ", ".join(f"c={r['concurrency']}: {r['dflash_break_even']:.2f}" for r in even))
    return lines + [""]


def main(argv=None) -> int:
    args = parse_args(argv)
    levels, ks = ints(args.concurrency, "--concurrency"), ints(args.ks, "--ks")
    if args.context < 1 or args.dflash_layers < 1:
        raise PipelineError("--context and --dflash-layers must be 1 or more")
    given = [read_report(t) for t in args.report] + [parse_arm(t) for t in args.arm]
    tables = load_tables(args.tables)
    kimi = json.loads(KIMI_CONFIG.read_text()) | {"_name": "Kimi-K2.5 INT4"}
    box = F.calibrate(kimi)
    groups = [("given arms", args.family, given)] if given else [
        (title, fam, [arm(n, a, {len(r): r}, al) for n, a, r, al in arms]) for title, fam, arms in MEASURED]
    print(f"The box: fixed {box.fixed_layer_ms * 1000:.0f} us a layer and routing share {box.routing_share:.3f}, "
          f"fitted to its public Kimi-K2.5 decode figures; {box.bandwidth_gb_s:,.0f} GB/s x {box.bandwidth_share} "
          f"(assumed reachable), {box.tflops:g} TFLOPS effective (assumed); context {args.context:,}, "
          f"KV {'fp8' if args.kv_cache_dtype == 'fp8' else 'bf16'}; DFlash {args.dflash_layers} layer(s)\n")
    out = []
    for title, fam, arms in groups:
        fw = forwards(fam, args, box, kimi, tables)
        rows = model(arms, fw, ks, levels)
        print("\n".join(render(f"{title}: {FAMILIES[fam]}", rows, levels, fw)))
        out += [r | {"group": title, "family": fam} for r in rows]
    if args.json:
        from eagle3_train.common.store import atomic_write_json

        atomic_write_json(args.json, {"box": box.__dict__, "context": args.context, "rows": out})
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
