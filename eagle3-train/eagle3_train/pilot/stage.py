"""The pilot: every stage on a small slice of the real run, each as its own process, into
<work-dir>/pilot, then one verdict table (pilot_report.json / .md).

  (first)  --target and --input checked; 05's held-out prompts, none of which 01b answers:
           --heldout-prompts, else the heldout.jsonl beside a split's train.jsonl (01_split_prompts),
           else --eval-prompts of the first --pilot-prompts + --eval-prompts of --input, held out by
           01_split_prompts' rule (prompts/heldout.jsonl; the others are prompts/train.jsonl)
  01b      --pilot-prompts prompts answered by the target (your server, --base-url, or one
           launched here for 01b only and stopped before 02, so 02's own server can have every GPU),
           tokenized
  screen   01b's answers screened for garbled output (common/screen.py): ok / warn / garbled
  02       hidden states (--extract-backend vllm launches its own server; hf for small targets, CPU)
  03       the draft vocabulary
  04       --budget steps (20), under torchrun with --nproc-per-node > 1
  05       acceptance offline and in vLLM (eagle3 arm, --eval-prompts prompts)

Rerunning the same command resumes: a finished stage whose manifest matches this run is skipped
(pilot/driver.py), the interrupted one resumes. Exit 0 when every stage ran and the screen did not
say garbled, else 1 (the table says which).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from eagle3_train.common.config import EVALUATE, EXTRACT, GENERATE, TOKENIZE, TRAIN, VOCAB
from eagle3_train.common.errors import PipelineError
from eagle3_train.common.manifest import MANIFEST
from eagle3_train.common.prompts import load_prompts
from eagle3_train.common.screen import GARBLED, OK, WARN, format_screen, screen_answers
from eagle3_train.common.split import pick_heldout
from eagle3_train.common.store import DirLock, atomic_write_json, atomic_write_text, read_jsonl
from eagle3_train.common.target import local_model_dir
from eagle3_train.common.layout import RAW
from eagle3_train.pilot.config import DEFAULT_MODEL_LEN
from eagle3_train.pilot.driver import DONE, FAILED, NOT_RUN, SKIPPED, Driver, Output, Step
from eagle3_train.split_prompts.stage import write_texts

REPORT = "pilot_report"  # .json and .md under <work-dir>/pilot
SCREEN = "screen.json"
# vLLM's acceptance length of the pilot's draft at or below this: no draft token was accepted, a
# broken link (features, layer ids, vocab mapping, export) rather than too few steps.
AL_NONE = 1.01
MODULES = {"01b": "eagle3_train.generate.cli", "02": "eagle3_train.extract.cli", "03": "eagle3_train.vocab.cli",
           "04": "eagle3_train.train.cli", "05": "eagle3_train.evaluate.cli"}


def _as_given(value: str) -> str:
    """A path the user gave, absolute (the stages record what they were passed); a name as it is."""
    return str(Path(value).resolve()) if Path(value).exists() else value


def load_format(raw_dir: Path, tokenizer: str | None, *, reasoning: bool):
    """The ChatFormat the screen needs (think and end-of-turn ids): the one 01c recorded in
    <raw_dir>/tokenized (no tokenizer to load), else `tokenizer`'s; None without either."""
    from eagle3_train.common.tokenization import ChatFormat, load_tokenizer

    recorded = Path(raw_dir) / "tokenized" / MANIFEST
    if recorded.exists():
        fmt = json.loads(recorded.read_text()).get("chat_format") or {}
        names = {f.name for f in dataclasses.fields(ChatFormat)} - {"tokenizer"}
        if names <= set(fmt) and fmt.get("end_of_turn_id") is not None:
            return ChatFormat(None, **{k: fmt[k] for k in names})
    if not tokenizer:
        return None
    return ChatFormat.from_tokenizer(load_tokenizer(tokenizer), reasoning=reasoning)


def screen_dir(raw_dir: Path, fmt) -> dict:
    raw = Path(raw_dir) / RAW
    if not raw.exists():
        raise PipelineError(f"{raw_dir} holds no {RAW} (not an 01b output directory)")
    return screen_answers(read_jsonl(raw), fmt)


def screen_only(cfg) -> int:
    """`--screen-only DIR`: the screen of an 01b directory (finished or still being written)."""
    raw_dir = cfg.screen_only
    tok = cfg.tokenizer or cfg.target
    if not tok and (raw_dir / MANIFEST).exists():
        tok = json.loads((raw_dir / MANIFEST).read_text()).get("config", {}).get("tokenizer")
    fmt = load_format(raw_dir, tok, reasoning=not cfg.no_reasoning)
    if fmt is None:
        print("pilot: no tokenizer (--tokenizer or --target, or one recorded by 01b): the reasoning check is skipped")
    result = screen_dir(raw_dir, fmt)
    print(format_screen(result))
    return 1 if result["verdict"] == GARBLED else 0


def model_len(cfg) -> int:
    if cfg.max_model_len:
        return cfg.max_model_len
    from eagle3_train.common.target_layout import raw_config

    conf = raw_config(cfg.target) or {}
    ctx = (conf.get("text_config") or conf).get("max_position_embeddings")
    return min(DEFAULT_MODEL_LEN, ctx) if isinstance(ctx, int) else DEFAULT_MODEL_LEN


@dataclass
class PilotPrompts:
    input: str             # 01b's --input (it takes --pilot-prompts of it)
    heldout: Path          # 05's --prompts
    texts: dict[str, str]  # files the pilot writes into its prompts/ (after the preflight)
    sha256: str | None     # of 01b's input file when the pilot writes it (what 01b's manifest must record)


def pilot_prompts(cfg, directory: Path) -> PilotPrompts:
    """What 01b answers and 05's held-out prompts, disjoint by id:
      --heldout-prompts FILE         --input as given; FILE, refused if 01b would answer one of its ids
      --input a split's train.jsonl  that split's heldout.jsonl (01_split_prompts)
      else                           the first --pilot-prompts + --eval-prompts of --input, split by
                                     01_split_prompts' rule into <directory>/train.jsonl (01b's
                                     input) and <directory>/heldout.jsonl (--eval-prompts of them)
    Reads only; the files are written by the caller."""
    from eagle3_train.split_prompts.config import HELDOUT_FILE, TRAIN_FILE
    from eagle3_train.split_prompts.stage import split_manifest, split_texts

    inp = _as_given(cfg.input)
    if cfg.heldout_prompts:
        heldout = _as_given(cfg.heldout_prompts)
        held = set(load_prompts(heldout, flag="--heldout-prompts").ids)
        answered = load_prompts(inp, split=cfg.split, limit=cfg.pilot_prompts).ids  # as 01b --limit takes them
        seen = [i for i in answered if i in held]
        if seen:
            raise PipelineError(f"{len(seen)} of {len(held)} --heldout-prompts ids are among the {len(answered)} "
                                f"prompts of --input that 01b answers (e.g. {', '.join(repr(i) for i in seen[:2])}): "
                                "pass a split's train.jsonl as --input and its heldout.jsonl (01_split_prompts.py)")
        return PilotPrompts(inp, Path(heldout), {}, None)
    if Path(inp).name == TRAIN_FILE and split_manifest(Path(inp)) is not None:
        heldout = Path(inp).parent / HELDOUT_FILE
        if not heldout.is_file():
            raise PipelineError(f"--input {inp} is a split's {TRAIN_FILE}, but its {HELDOUT_FILE} is not there: "
                                "rerun 01_split_prompts.py, or pass --heldout-prompts")
        return PilotPrompts(inp, heldout, {}, None)
    ps = load_prompts(inp, split=cfg.split, limit=cfg.pilot_prompts + cfg.eval_prompts)
    spare = len(ps.prompts) - cfg.pilot_prompts
    if spare < 1:
        raise PipelineError(f"--input {cfg.input} has only {len(ps.prompts)} prompts, none left after the "
                            f"pilot's {cfg.pilot_prompts} for 05: pass --heldout-prompts or a smaller --pilot-prompts")
    texts = split_texts(ps.prompts, pick_heldout(ps.ids, min(cfg.eval_prompts, spare)))
    return PilotPrompts(str(Path(directory) / TRAIN_FILE), Path(directory) / HELDOUT_FILE, texts,
                        hashlib.sha256(texts[TRAIN_FILE].encode()).hexdigest())


def run(cfg) -> int:
    if cfg.screen_only is not None:
        return screen_only(cfg)
    out = cfg.out.resolve()
    with DirLock(out, "pilot"):
        return _run(cfg, out)


def _run(cfg, out: Path) -> int:
    drv = Driver(out, "pilot", flag="--work-dir", summary=out / f"{REPORT}.json")
    py = sys.executable
    extra = cfg.stage_args
    d = {k: out / k for k in ("prompts", "01b", "02", "03", "04", "05")}
    tokenized = d["01b"] / "tokenized"
    target = _as_given(cfg.target)
    tok = _as_given(cfg.tokenizer) if cfg.tokenizer else target
    local_model_dir(cfg.target, what="--target")
    # 01b's prompts and 05's, disjoint by id; a bad --input is refused here, before any stage
    chosen = pilot_prompts(cfg, d["prompts"])
    inp, heldout = chosen.input, chosen.heldout
    parser = None if cfg.reasoning_parser == "none" else cfg.reasoning_parser
    tp = ["--tensor-parallel-size", str(cfg.tensor_parallel_size)] if cfg.tensor_parallel_size > 1 else []
    serve = (["=".join(tp)] if tp else []) + list(cfg.server_arg)  # every server the pilot or 05 launches
    startup = ["--startup-timeout", cfg.startup_timeout] if cfg.startup_timeout else []
    served = cfg.model or Path(cfg.target).name
    screen: dict = {}

    def stage(key: str, *args) -> list:
        return [py, "-m", MODULES[key], *args, *extra[key]]

    def gen():
        server = None
        url = cfg.base_url
        if url is None:
            from eagle3_train.common.vllm_server import VllmServer

            server = VllmServer(target, served_name=served, max_model_len=model_len(cfg), reasoning_parser=parser,
                                extra_args=serve, startup_timeout=cfg.startup_timeout,
                                log_path=d["01b"] / "vllm.log")
            url = server.base_url
        opt = [*(["--max-tokens", cfg.max_tokens] if cfg.max_tokens else []),
               *(["--temperature", cfg.temperature] if cfg.temperature is not None else []),
               *(["--no-reasoning"] if cfg.no_reasoning else [])]
        drv.generate(stage("01b", "--input", inp, "--split", cfg.split, "--limit", cfg.pilot_prompts,
                           "--output-dir", d["01b"], "--base-url", url, "--model", served,
                           "--concurrency", cfg.concurrency, "--timeout", cfg.timeout, *opt,
                           "--tokenize", "--tokenizer", tok), server)

    def do_screen():
        fmt = load_format(d["01b"], tok, reasoning=not cfg.no_reasoning)
        screen.update(screen_dir(d["01b"], fmt))
        atomic_write_json(out / SCREEN, screen)
        print(format_screen(screen), flush=True)

    def extract():
        args = ["--input", tokenized, "--model", target, "--output-dir", d["02"], "--backend", cfg.extract_backend,
                *(["--storage", cfg.storage] if cfg.storage else [])]
        if cfg.extract_backend == "vllm":
            args += ["--launch-server", *tp, *startup,
                     *(["--vllm-args", shlex.join(cfg.server_arg)] if cfg.server_arg else [])]
        drv.call(stage("02", *args))

    def train():
        args = ["--hidden-states", d["02"], "--vocab-mapping", d["03"], "--target", target,
                "--output-dir", d["04"], "--budget", cfg.budget]
        if cfg.nproc_per_node > 1:
            drv.call([py, "-m", "torch.distributed.run", "--nproc-per-node", cfg.nproc_per_node,
                      "-m", MODULES["04"], *args, *extra["04"]])
        else:
            drv.call(stage("04", *args))

    made_for = {"config.target": target}
    steps = [
        Step("01b_generate_synthetic", f"{cfg.pilot_prompts} prompts answered by the target "
             + (f"at {cfg.base_url}" if cfg.base_url else "(a vLLM launched for 01b)") + ", tokenized", gen,
             (Output(d["01b"], GENERATE, {"config.input": inp, "config.limit": cfg.pilot_prompts,
                                          # the pilot's own train.jsonl: the same path whatever --input was
                                          **({"inputs.prompts.sha256": chosen.sha256} if chosen.sha256 else {}),
                                          "config.max_tokens": cfg.max_tokens, "config.temperature": cfg.temperature,
                                          "config.tokenizer": tok}),
              Output(tokenized, TOKENIZE, {"tokenizer.name_or_path": tok}))),
        Step("screen", "01b's answers screened for garbled output", do_screen),
        Step("02_extract_hidden_states", f"hidden states ({cfg.extract_backend} backend)", extract,
             (Output(d["02"], EXTRACT, {"config.model": target,
                                        **({"config.storage": cfg.storage} if cfg.storage else {})}),)),
        Step("03_build_vocab_mapping", "the draft vocabulary",
             lambda: drv.call(stage("03", "--data", tokenized, "--target", target, "--output-dir", d["03"],
                                    *(["--draft-vocab-size", cfg.draft_vocab_size] if cfg.draft_vocab_size else []))),
             (Output(d["03"], VOCAB, {**made_for, **({"config.draft_vocab_size": cfg.draft_vocab_size}
                                                     if cfg.draft_vocab_size else {})}),)),
        Step("04_train", f"the draft for --budget {cfg.budget}", train,
             (Output(d["04"], TRAIN, {**made_for, "config.budget": cfg.budget}),)),
        Step("05_evaluate", f"acceptance offline and in vLLM on {cfg.eval_prompts} held-out prompts",
             lambda: drv.call(stage("05", "--draft", d["04"] / "export", "--target", target, "--store", d["02"],
                                    "--prompts", heldout, "--output-dir", d["05"], "--num-prompts", cfg.eval_prompts,
                                    "--concurrency", cfg.eval_prompts, "--arms", "eagle3",
                                    "--reasoning-parser", cfg.reasoning_parser, *startup,
                                    *(f"--server-arg={a}" for a in serve))),
             (Output(d["05"], EVALUATE, {**made_for, "config.num_prompts": cfg.eval_prompts,
                                         "config.arms": "eagle3"}),)),
    ]
    # Bad inputs and another run's outputs are refused before anything runs (one error line, exit 2).
    drv.preflight(steps)
    write_texts(d["prompts"], chosen.texts)
    n = len(steps) + 1
    failed = None
    for i, step in enumerate(steps, 1):
        try:
            drv.run(i, n, step)
        except PipelineError as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            failed = (step.key, str(e))
            break
    if not screen and (out / SCREEN).exists() and drv.status.get("screen") != FAILED:
        screen = json.loads((out / SCREEN).read_text())  # a failure before the screen ran this time
    drv.banner(n, n, "report", f"{out / (REPORT + '.md')}")
    report = build_report(cfg, out, drv, [s.key for s in steps], screen, failed)
    report["full_run_01b"] = measure_01b(cfg, out)
    drv.save(**report)
    md = format_report(report)
    atomic_write_text(out / f"{REPORT}.md", md)
    print(md, flush=True)
    return 0 if report["verdict"] in (OK, WARN) else 1


def measure_01b(cfg, out: Path) -> dict | None:
    """01b's measured rates and lengths -> <out>/gen_rates.json (00_plan reads it), and the full run's
    01b planned from them; None before 01b finished, {"error": why} where they cannot be measured."""
    from eagle3_train.pilot import rates

    raw_dir = out / "01b"
    if not (raw_dir / MANIFEST).exists():
        return None
    try:
        measured = rates.gen_rates(raw_dir, rates.read_01b(raw_dir), cfg.server_arg)
        atomic_write_json(out / rates.GEN_RATES, measured)
        samples = cfg.samples or len(load_prompts(cfg.input, split=cfg.split).prompts)
        return {"gen_rates": str(out / rates.GEN_RATES), "samples_from": "--samples" if cfg.samples else
                "the prompts of --input", **rates.full_run(cfg.target, measured, samples, cfg.tensor_parallel_size,
                                                           cfg.max_tokens)}
    except PipelineError as e:
        return {"error": str(e)}


def _acceptance(out: Path) -> dict:
    path = out / "05" / "report.json"
    if not path.exists():
        return {}
    rep = json.loads(path.read_text())
    spec = (((rep.get("online") or {}).get("arms") or {}).get("eagle3") or {}).get("spec") or {}
    # acceptance along the answer: vLLM's (the draft's arm) where 05 counted it, else the offline walk's
    series = rep.get("by_position") or {}
    name = next((n for n in ("eagle3", "offline") if n in series), None)
    return {"vllm": spec.get("acceptance_length"), "offline": (rep.get("offline") or {}).get("acceptance_length"),
            "k": rep.get("k"), "by_position": {"name": name, **series[name]} if name else None}


def position_lines(al: dict) -> list[str]:
    """pilot_report.md's table of 05's acceptance by position (none when 05 did not count it)."""
    from eagle3_train.common import positions

    part = al.get("by_position")
    if not part:
        return []
    where = "in vLLM" if part["name"] == "eagle3" else "offline (simulated)"
    return ["", f"## 05: acceptance along the answer, {where}, K = {part['k']}", "",
            positions.table(part["rows"], part["k"])]


def build_report(cfg, out: Path, drv: Driver, keys: list[str], screen: dict, failed) -> dict:
    rows = []
    for key in keys:
        status = drv.status.get(key, NOT_RUN)
        row = {"stage": key, "status": {DONE: OK, SKIPPED: OK}.get(status, status),
               "earlier_run": status == SKIPPED, "seconds": round(drv.times.get(key, 0.0))}
        if key == "screen" and screen and status != FAILED:
            row["status"] = screen["verdict"]
        if key == "01b" and (out / "01b" / MANIFEST).exists():
            counts = json.loads((out / "01b" / MANIFEST).read_text()).get("counts", {})
            row["note"] = f"{counts.get('answered')}/{counts.get('requested')} answered, {counts.get('failed')} failed"
        if failed and failed[0] == key:
            row["error"] = failed[1]
        rows.append(row)
    al = _acceptance(out)
    reasons = []
    if failed:
        reasons.append(f"{failed[0]} failed: {failed[1]}")
        if failed[0] == "02" and cfg.base_url and cfg.extract_backend == "vllm":
            reasons.append(f"02 launches a vLLM of its own: if the server at {cfg.base_url} holds the GPUs, stop "
                           "it and rerun the pilot (01b's answers are kept)")
    if screen.get("verdict") in (WARN, GARBLED):
        reasons += [f"screen: {r}" for r in screen["reasons"]]
    if al.get("vllm") is not None and al["vllm"] <= AL_NONE:
        reasons.append(f"05: vLLM accepted no draft token (AL {al['vllm']:.2f}): a broken link between the "
                       "stages (features, layer ids, vocab mapping, export), or far too few steps")
    verdict = FAILED if failed else GARBLED if screen.get("verdict") == GARBLED else \
        WARN if reasons else OK
    return {"verdict": verdict, "reasons": reasons, "stages": rows, "acceptance_length": al,
            "screen": screen, "target": cfg.target, "input": cfg.input, "sizes": {
                "pilot_prompts": cfg.pilot_prompts, "budget": cfg.budget, "eval_prompts": cfg.eval_prompts}}


def format_report(rep: dict) -> str:
    al = rep["acceptance_length"]
    lines = [f"# Pilot: {rep['target']}", "",
             f"{rep['sizes']['pilot_prompts']} prompts of {rep['input']}, 04 --budget {rep['sizes']['budget']}, "
             f"05 on {rep['sizes']['eval_prompts']} held-out prompts.", "",
             "| stage | status | time | note |", "|---|---|---|---|"]
    for r in rep["stages"]:
        note = "; ".join(filter(None, [r.get("note"), "done in an earlier run" if r["earlier_run"] else ""]))
        if r["stage"] == "05" and al.get("vllm") is not None:
            off = f" (offline {al['offline']:.2f})" if al.get("offline") is not None else ""
            note = f"acceptance length {al['vllm']:.2f} in vLLM{off}, K={al.get('k')}"
        if r.get("error"):
            note = r["error"]
        lines.append(f"| {r['stage']} | {r['status']} | {r['seconds']} s | {note} |")
    lines += ["", f"**Verdict: {rep['verdict']}**"]
    lines += [f"- {r}" for r in rep["reasons"]]
    lines += position_lines(al)
    if rep["screen"]:
        lines += ["", "```", format_screen(rep["screen"]), "```"]
    full = rep.get("full_run_01b")
    if full and full.get("error"):
        lines += ["", f"01b's rates were not measured: {full['error']}"]
    elif full:
        lines += ["", f"## 01b of the full run, from the pilot's measured rates ({full['gen_rates']})", "",
                  f"{full['samples']:,} prompts ({full['samples_from']}): 01b {full['hours']:,.1f} h at "
                  f"{full['tok_s']:,.0f} tok/s, --concurrency auto ~{full['concurrency']}." if full["hours"] is not None
                  else f"{full['samples']:,} prompts ({full['samples_from']}): 01b never finishes (see below).",
                  "", f"tok/s: {full['rate_source']}", "", "```", *full["lines"], "```", "",
                  "The whole run's plan from the same figures: `00_plan.py --target ... --samples N --work-dir W` "
                  "(it reads pilot/gen_rates.json)."]
    if rep["verdict"] in (OK, WARN):
        lines += ["", "The pilot's draft trained for a few steps only: its acceptance length shows that the "
                  "chain works, not what the full run reaches. Next: the full run (README, 'Running it for real')."]
    return "\n".join(lines) + "\n"
