"""00_plan: the plan (planner.plan's dict) printed as the lines a user reads, one row per stage,
then 01b's concurrency and capture choices and 04's memory parts; --json prints the dict."""

from __future__ import annotations

import json

from eagle3_train.plan import planner as P
from eagle3_train.plan.planner import GB


def table(p: dict) -> str:
    """The plan as a fixed-width table, one row per stage."""
    def gb(x):
        return "-" if not x else f"{x / GB:,.1f} GB" if x >= 0.1 * GB else f"{x / 1e6:,.1f} MB"

    rows = [f"{'stage':<6}{'disk':>12}{'GPU mem':>12}{'tokens':>16}{'tok/s':>10}{'hours':>9}  rate"]
    for name, s in p["stages"].items():
        h = s.get("hours", 0)
        rows.append(f"{name:<6}{gb(s.get('disk')):>12}{gb(s.get('gpu_memory')):>12}{s.get('tokens', 0):>16,}"
                    f"{s.get('rate_tok_s', 0):>10,.0f}{'never' if h is None else f'{h:.1f}':>9}  "
                    f"{s.get('rate_source', '')}")
    rows += gen_lines(p["stages"]["01b"], p["flags"])
    rows += capture_lines(p, gb)
    m = p["stages"]["04"]["memory_parts"]
    s4 = p["stages"]["04"]
    what = f"DFlash block {s4['block_size']} draft" if s4["draft"] == "dflash" else f"{s4['draft']} draft layer"
    if (n := p["flags"]["draft_layers"]) > 1:
        what += f", {n} layers reading {p['flags']['n_aux']} target layers"
    rows.append(f"04 {what}, {s4['epochs']} epoch(s) = {s4['steps']:,} steps")
    rows.append(f"04 per GPU: weights {gb(m['weights'])}, grads+optimizer {gb(m['grads_and_adam'])}, target head "
                f"{gb(m['target_head'])}, activations {gb(m['activations'])} "
                f"({m['trainable_params'] / 1e6:,.0f}M trainable of {m['params'] / 1e6:,.0f}M)")
    rows.append(f"04 checkpoint {gb(s4['checkpoint'])}; export bf16 {gb(s4['export_bf16'])}, "
                f"fp32 {gb(s4['export_fp32'])}; disk total {gb(p['disk_total'])}")
    return "\n".join(rows)


FP8_COST = ("--kv-cache-dtype fp8 changes the target's numerics (its KV cache rounded to fp8): generate, extract "
            "and evaluate with the KV dtype you will serve with")
DCP_COST = ("--decode-context-parallel-size does not combine with speculative decoding on TRITON_MLA (vLLM 0.32): "
            "for 01b's and 02's servers, never 05's, nor 01b --capture-hidden-states; each step gathers the "
            "ranks' attention (tok/s per level assumed unchanged: the pilot measures it)")


def _h(x) -> str:
    return "never" if x is None else f"{x:,.1f} h"


def gen_lines(gen: dict, flags: dict) -> list[str]:
    """01b's servers under the table: the KV cache, the answers' lengths, the level --concurrency auto
    should reach and its tok/s, the hours at fixed levels, the cache options and their costs."""
    serve, a = gen["serving"], gen["answers"]
    n, tp = serve["servers"], serve["gpus_per_server"]
    dtype = "fp8" if serve["kv_cache_dtype"] == "fp8" else f"{flags['kv_dtype_bytes']} B, the model's dtype"
    head = (f"01b {n} vLLM server{'s' if n > 1 else ''}, {tp} GPU{'s' if tp > 1 else ''} each (TP {tp}), "
            f"{serve['kv_bytes_per_token']:,} B of KV cache a token ({dtype})")
    count = f"{a['count']:,} answers: " if a.get("count") else ""
    answers = (f"01b answers: {count}mean {a['mean']:,.0f}, p50 {a['p50']:,}, p90 {a['p90']:,}, p99 {a['p99']:,}, "
               f"max {a['max']:,} tokens ({a['source']}); one in flight holds {serve['typical_tokens']:,} tokens "
               f"on average ({flags['gen_prompt_tokens']:,} prompt + E[a^2]/2E[a] {a['resident']:,.0f})")
    if "concurrency" not in serve:
        return [f"{head}; its size is unknown (no weight files here): pass --weights-gb (Kimi-K2.5 INT4: ~554) "
                "for the level --concurrency auto reaches", answers]
    if serve.get("measured_cache"):
        cache = f"01b KV cache {serve['resident_tokens']:,} tokens a server (measured: 01b's /metrics)"
    else:
        per_gpu, util = flags["gpu_memory_gb"] * flags["gpu_memory_utilization"], flags["gpu_memory_utilization"]
        cache = (f"01b per GPU: {per_gpu:,.1f} GB (--gpu-memory-utilization {util:g}) - weights "
                 f"{serve['weights_per_gpu'] / GB:,.1f} GB - reserve {flags['activation_reserve_gb']:g} GB (assumed) "
                 f"= KV cache {serve['kv_cache_per_gpu'] / GB:,.1f} GB = {serve['gpu_tokens']:,} tokens"
                 + (f" x --decode-context-parallel-size {serve['dcp']} = {serve['resident_tokens']:,} a server"
                    if serve["dcp"] > 1 else ""))
    rows = [head, cache, answers]
    if not serve["concurrency"]:
        return rows + [f"01b: not one answer of {serve['request_tokens']:,} tokens fits: fewer --gen-servers "
                       "(more GPUs each), a lower --gen-max-tokens, --kv-cache-dtype fp8, or smaller weights"]
    auto, worst = serve["concurrency"] * n, serve["worst_case"] * n
    rows.append(f"01b --concurrency auto should reach ~{auto} ({serve['concurrency']} a server: the cache filled by "
                f"answers' typical residency; worst case {worst}, every answer {flags['gen_prompt_tokens']:,} + "
                f"{flags['gen_max_tokens']:,} tokens; mean-based {serve['mean_level'] * n}): "
                f"{gen['rate_tok_s']:,.0f} tok/s, {_h(gen['hours'])}")
    fixed = "; ".join(f"{r['concurrency']}: {r['tok_s']:,.0f} tok/s, {_h(r['hours'])}"
                      + (" (over the cache: preempts)" if r["over_cache"] else "") for r in gen["fixed"])
    rows.append(f"01b fixed --concurrency: {fixed}")
    if gen.get("options"):
        rows.append("01b other caches: " + "; ".join(
            f"{_cache_flags(o)}: {o['resident_tokens']:,} tokens, auto ~{o['concurrency']}, {o['tok_s']:,.0f} tok/s, "
            f"{_h(o['hours'])}" for o in gen["options"]))
    used = [o for o in ("fp8", "dcp") if (o == "fp8" and serve["kv_cache_dtype"] == "fp8") or
            (o == "dcp" and serve["dcp"] > 1)]
    shown = {o["kv_cache_dtype"] for o in gen.get("options", [])} | {"dcp" for o in gen.get("options", [])
                                                                     if o["dcp"] > 1}
    costs = [FP8_COST if o == "fp8" else DCP_COST for o in ("fp8", "dcp") if o in used or o in shown]
    return rows + [f"01b cost: {c}" for c in costs]


def _cache_flags(o: dict) -> str:
    return " ".join(filter(None, ["--kv-cache-dtype fp8" if o["kv_cache_dtype"] == "fp8" else "",
                                  f"--decode-context-parallel-size {o['dcp']}" if o["dcp"] > 1 else ""]))


def capture_lines(p: dict, gb) -> list[str]:
    """Both paths to 02's store (plan()['capture']): the capturing server, the hours and disk of each,
    and which is cheaper by how much."""
    c, s = p["capture"], p["stages"]
    row, serve, two = c["01b"], c["01b"]["serving"], c["two_pass"]
    n_aux, H, dt = p["flags"]["n_aux"], p["target"]["hidden"], p["flags"]["kv_dtype_bytes"]

    def h(x):
        return "never" if x is None else f"{x:,.1f} h"

    cache = (f"KV {serve['kv_bytes_per_token']:,} + hidden states {serve['hidden_bytes_per_token']:,} B a token "
             f"({n_aux + 1} layers x {H:,} x {dt} B)")
    if "concurrency" in serve:
        fits = serve["concurrency"]
        cache += (f" = {serve['resident_tokens']:,} tokens a server: --concurrency auto ~{fits * serve['servers']} "
                  f"(worst case {serve['worst_case'] * serve['servers']})" if fits else
                  f": not one answer of {serve['request_tokens']:,} tokens fits")
    else:
        cache += f": ~{serve['batch']} answers in flight (KV cache unknown: pass --weights-gb)"
    rows = [f"01b --capture-hidden-states (no 02): {cache}; {serve['tokens_per_step']} tokens a step: "
            f"{row['rate_tok_s']:,.0f} tok/s, {h(row['hours'])} ({row['rate_source']})",
            f"paths to 02's store: two-pass 01b + 02 = {h(s['01b']['hours'])} + {h(s['02']['hours'])} = "
            f"{h(two['hours'])}, disk {gb(two['disk'])}; capture {h(row['hours'])}, disk {gb(row['disk'])} "
            f"+ up to {gb(row['scratch_disk'])} of per-request files in flight",
            f"capture's host memory: up to {gb(row['host_memory'])} of pinned buffers on the node running rank 0 "
            f"(one a request in flight, {gb(row['host_memory'] / max(1, serve.get('concurrency', serve['batch']) * serve['servers']))} "
            "each: its states rounded up to a power of two), all gathered through GPU 0: lower --max-concurrency "
            "if the host has less"]
    if c["cheaper"] is None:
        return rows + ["cheaper: neither path finishes (see 01b's servers above)"]
    name = {"capture": "capture (01b --capture-hidden-states)", "two_pass": "two-pass (01b, then 02)"}[c["cheaper"]]
    cheap, other = (row["hours"], two["hours"]) if c["cheaper"] == "capture" else (two["hours"], row["hours"])
    # hours are rounded to 0.01: a run of a few samples plans both paths at 0
    ratio = f"the other takes {other / cheap:.2f}x as long" if cheap else "both under a minute"
    by = "the other never finishes" if c["saves_hours"] is None else f"by {c['saves_hours']:,.1f} h ({ratio})"
    return rows + [f"cheaper: {name}, {by}; disk {gb(c['saves_disk'])} less (the same answers and store)"]


def run(cfg) -> int:
    """00_plan: print the plan of the run `cfg` (a plan.config.PlanConfig) describes."""
    shape = P.load_shape(cfg.target)  # a bad --target is the one line, before any note
    result = P.plan(shape, P.flags_from(cfg, shape))
    print(json.dumps(result, indent=1) if cfg.json else table(result))
    return 0
