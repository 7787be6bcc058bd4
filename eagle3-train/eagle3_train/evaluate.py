"""05_evaluate: how many draft tokens the target accepts, simulated offline and measured in vLLM.

Offline (no server): the draft runs over held-out samples of the 02 store exactly as vLLM runs it
(target features at t and token t+1 in, K chained proposals out) and each proposal is compared with
the target's own greedy token; acceptance is the chain rule of `acceptance.chain_acceptance`.

Online: a real vLLM server per arm -- `eagle3` (the draft), `none` (no speculation), `ngram`
(prompt lookup) -- the same held-out prompts and sampling settings in every arm, at a few
concurrency levels; the spec-decode counters of /metrics are read before and after each level, so
AL = 1 + accepted / drafts and the per-position rates are vLLM's own.

Output directory:
  run.json          the resolved settings + input hashes of this evaluation (a rerun must match)
  offline.json      the offline result          } each written atomically when finished, kept by
  arms/<arm>.json   one online arm's result     } a rerun (resume = the parts still missing)
  report.json, report.md, acceptance.png, vllm-<arm>.log, progress.log
  manifest.json     written last
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from .acceptance import chain_acceptance, draft_correctness, merge, summarize
from .draft import draft_to_target
from .errors import PipelineError
from .manifest import describe_file, require_match
from .progress import Progress
from .store import atomic_write_bytes, atomic_write_json, atomic_write_text, json_sha256

STAGE = "05_evaluate"
ARMS = ("eagle3", "none", "ngram")
RUN = "run.json"
OFFLINE = "offline.json"
ARMS_DIR = "arms"
REPORT_JSON, REPORT_MD, PLOT = "report.json", "report.md", "acceptance.png"

SPEC_DRAFTS = "vllm:spec_decode_num_drafts_total"
SPEC_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
SPEC_ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
SPEC_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"


# ----------------------------------------------------------------------------- the draft

def read_draft_config(draft_dir: Path) -> dict:
    """The export's config.json, checked to be a speculators EAGLE-3 draft."""
    path = Path(draft_dir) / "config.json"
    if not path.exists():
        raise PipelineError(f"{draft_dir} is not a draft export (no config.json); pass 04's export/ dir")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise PipelineError(f"{path} is not valid JSON ({e.msg})") from None
    if cfg.get("speculators_model_type") != "eagle3":
        raise PipelineError(f"{path} has speculators_model_type={cfg.get('speculators_model_type')!r}, "
                            "expected 'eagle3' (a speculators-format EAGLE-3 export)")
    return cfg


def draft_k(cfg: dict) -> int:
    """Speculative tokens the draft was exported for (speculators_config.proposal_methods[0])."""
    try:
        return int(cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"])
    except (KeyError, IndexError, TypeError, ValueError):
        raise PipelineError("draft config.json has no speculators_config.proposal_methods[0]"
                            ".speculative_tokens; pass --num-speculative-tokens") from None


def draft_target(cfg: dict) -> str | None:
    return (cfg.get("speculators_config") or {}).get("verifier", {}).get("name_or_path")


def describe_draft(draft_dir: Path) -> dict:
    """Identity of an export: its files' hashes, plus 04's manifest where the export sits in a run."""
    draft_dir = Path(draft_dir)
    files = {p.name: describe_file(p) for p in sorted(draft_dir.iterdir())
             if p.is_file() and not p.name.startswith(".") and p.suffix in (".json", ".safetensors")}
    out = {"path": str(draft_dir.resolve()), "files": files,
           "sha256": json_sha256({n: f["sha256"] for n, f in files.items()})}
    for d in (draft_dir, draft_dir.parent):
        m = d / "manifest.json"
        if m.exists() and m != draft_dir / "config.json":
            try:
                man = json.loads(m.read_text())
            except json.JSONDecodeError:
                continue
            # Where 04's split is read from; the export's own files are what identify the draft.
            out["manifest"] = {"path": str(m.resolve()), "stage": man.get("stage")}
            break
    else:
        from .train import RUN

        if (draft_dir.parent / RUN).exists():  # a 04 run directory: its export counts only once it finished
            raise PipelineError(f"{draft_dir} belongs to the 04 run {draft_dir.parent}, which did not finish "
                                "(no manifest.json); resume 04 with the same command, or copy the export "
                                "out of the run directory to evaluate it as it is")
    return out


def load_draft(draft_dir: Path, target: Path):
    """The export as speculators' Eagle3DraftModel, on CPU with sdpa attention (flex attention
    needs a GPU). Built from its config and loaded from its weights directly, so a draft narrower
    than the target (fc of n_aux * target_hidden, see draft.py) loads too; embed_tokens comes from
    the target when the export leaves it out (vLLM shares the target's then)."""
    from safetensors.torch import load_file
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    from .draft import load_target_weights

    draft_dir = Path(draft_dir)
    config = Eagle3SpeculatorConfig.from_pretrained(str(draft_dir))
    config.transformer_layer_config._attn_implementation = "sdpa"
    files = sorted(draft_dir.glob("*.safetensors"))
    if not files:
        raise PipelineError(f"{draft_dir} has no *.safetensors weights")
    state = {}
    for f in files:
        state.update(load_file(str(f)))
    model = Eagle3DraftModel(config)
    fc = state.get("fc.weight")
    if fc is not None and fc.shape != model.fc.weight.shape:
        model.fc = torch.nn.Linear(fc.shape[1], fc.shape[0], bias=False)
    if "embed_tokens.weight" not in state:
        state["embed_tokens.weight"] = load_target_weights(target)["embed"]
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not m.startswith("verifier_")]  # training-only copies
    if missing or unexpected:
        raise PipelineError(f"{draft_dir}: weights do not fit its config.json (missing {missing[:4]}, "
                            f"unexpected {list(unexpected)[:4]})")
    return model.float().eval()


def load_target_head(target: Path):
    """The target's final norm + lm_head (04's TargetHead): greedy tokens from stored last states."""
    from .draft import load_target_weights, target_head
    from .target_layout import load_config

    return target_head(load_config(target), load_target_weights(target), None, "cpu", torch.float32)


# ----------------------------------------------------------------------------- offline

def heldout_ids(store_ids: Sequence[str], draft: dict) -> tuple[list[str], str]:
    """The store's samples the draft was not trained on, by the split 04 recorded in its manifest:
    an explicit id list, or the fixed by-id rule with its fraction. Without either, every
    sample (and the report says so)."""
    from .train import STAGE as TRAIN_STAGE

    found = draft.get("manifest") or {}
    man = json.loads(Path(found["path"]).read_text()) if found.get("stage") == TRAIN_STAGE else {}
    split = man.get("split") or {}
    ids = split.get("heldout_ids") or split.get("val_ids") or man.get("val_ids")
    if ids:
        keep = set(ids)
        return [i for i in store_ids if i in keep], "04 manifest (held-out ids)"
    fraction = split.get("heldout_fraction", split.get("val_fraction"))
    if fraction:
        from .vocab import is_heldout

        return [i for i in store_ids if is_heldout(i, float(fraction))], f"by-id split, fraction {fraction}"
    return list(store_ids), "all samples (the draft's manifest records no held-out split)"


def _store_aux_ids(store) -> list[int]:
    """02 records `aux_layer_ids`, and `layer_ids` = aux + [N] (the last layer's output)."""
    if store.manifest.get("aux_layer_ids") is not None:
        return list(store.manifest["aux_layer_ids"])
    ids = list(store.layer_ids)
    n = (store.manifest.get("target") or {}).get("num_hidden_layers")
    return ids[:-1] if n is not None and ids and ids[-1] == n else ids


def check_store(store, cfg: dict, target_desc: dict) -> None:
    """Refuse a store made for another target, or with other layers than the draft reads."""
    theirs = store.manifest.get("target") or {}
    for key in ("hidden_size", "vocab_size", "num_hidden_layers"):
        if key in theirs:
            require_match(f"target {key}", target_desc[key], theirs[key], source=str(store.directory))
    want = cfg.get("eagle_aux_hidden_state_layer_ids")
    if want:
        require_match("auxiliary layer ids", list(want), _store_aux_ids(store), source=str(store.directory))


def _batches(ids: Sequence[str], lengths: dict[str, int], tokens_per_batch: int):
    batch, n = [], 0
    for sid in ids:
        if batch and n + lengths[sid] > tokens_per_batch:
            yield batch
            batch, n = [], 0
        batch.append(sid)
        n += lengths[sid]
    if batch:
        yield batch


@torch.no_grad()
def draft_step_tokens(model, samples: list, k: int) -> list[list[torch.Tensor]]:
    """Run the draft over several samples packed into one sequence and return, per sample, the
    K proposals (target vocabulary) at each drafting position, in the frame of
    `acceptance.draft_correctness`: position j holds token t = j + 1 and the features of j.

    vLLM drafts from (features of t-1, token t) and proposes t+1, t+2, ...; the proposal at depth
    k > 0 is fed the earlier ones. The forward feeds the true tokens instead (teacher forcing),
    which is the same thing whenever the earlier proposals were right, the only case the chain
    rule counts."""
    hs, ids, docs, pos = [], [], [], []
    for d, s in enumerate(samples):
        n = s.input_ids.shape[0] - 1
        hs.append(s.aux[:-1].flatten(1))
        ids.append(s.input_ids[1:])
        docs.append(torch.full((n,), d, dtype=torch.long))
        pos.append(torch.arange(1, n + 1))
    out = model(hidden_states=torch.cat(hs)[None].float(), input_ids=torch.cat(ids)[None],
                document_ids=torch.cat(docs)[None], position_ids=torch.cat(pos)[None], ttt_steps=k)
    to_target = draft_to_target(model)
    steps = [to_target(t[0]) for t in out]
    per_sample, a = [], 0
    for s in samples:
        n = s.input_ids.shape[0] - 1
        per_sample.append([t[a:a + n] for t in steps])
        a += n
    return per_sample


def offline_eval(model, head, store, ids: Sequence[str], k: int, *,
                 tokens_per_batch: int = 4096, log_path: Path | None = None) -> dict:
    """Chain acceptance of the draft against the target's greedy tokens over `ids`."""
    from .train import read_sample  # the same damaged-shard / NaN checks as training

    lengths = {sid: store.length(sid) for sid in ids}
    stats, tokens, same, supervised = [], 0, 0, 0
    with Progress("05 offline", len(ids), log_path=log_path, unit="sample") as prog:
        for batch in _batches(ids, lengths, tokens_per_batch):
            samples = [s for s in (read_sample(store, sid) for sid in batch) if s.input_ids.shape[0] >= 2]
            drafts = draft_step_tokens(model, samples, k) if samples else []
            for s, d in zip(samples, drafts):
                if s.last is not None and head is not None:
                    greedy = head.greedy(s.last)
                elif s.topk_ids is not None:
                    greedy = s.topk_ids[:, 0]
                else:
                    raise PipelineError(f"{store.directory} keeps neither the last hidden state nor "
                                        "top-k, so the target's greedy tokens are unknown")
                # Shifted frame (see draft_step_tokens): reference for token j+1 is greedy at j+1.
                ref = greedy[1:]
                ids_s, mask_s = s.input_ids[1:], s.loss_mask[1:]
                correct, valid = draft_correctness(d, ids_s, mask_s, ref)
                stats.append(chain_acceptance(correct, valid))
                tokens += int(s.input_ids.shape[0])
                m = s.loss_mask[1:].bool()
                same += int((greedy[:-1][m] == s.input_ids[1:][m]).sum())
                supervised += int(m.sum())
            prog.update(len(batch), tokens=sum(lengths[i] for i in batch))
    if not stats:
        raise PipelineError(f"no held-out samples with at least 2 tokens in {store.directory}")
    counts = merge(stats)
    return {**summarize(counts), "counts": counts, "k": k, "samples": len(stats), "tokens": tokens,
            # How far the data is from the target's greedy choice: 1.0 = greedily generated.
            "data_matches_greedy": same / supervised if supervised else None}


# ----------------------------------------------------------------------------- online

def spec_config(arm: str, draft_dir: Path, k: int, ngram: tuple[int, int]) -> dict | None:
    if arm == "none":
        return None
    if arm == "eagle3":
        return {"method": "eagle3", "model": str(Path(draft_dir).resolve()), "num_speculative_tokens": k}
    if arm == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k,
                "prompt_lookup_min": ngram[0], "prompt_lookup_max": ngram[1]}
    raise PipelineError(f"unknown arm {arm!r}; choose from {', '.join(ARMS)}")


_LABEL = re.compile(r'position="(\d+)"')


def spec_counters(metrics: dict[str, float]) -> dict:
    """vLLM's spec-decode counters, summed over engines: drafts, draft_tokens, accepted, per_pos."""
    out = {"drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0, "per_pos": {}}
    names = {SPEC_DRAFTS: "drafts", SPEC_DRAFT_TOKENS: "draft_tokens", SPEC_ACCEPTED: "accepted"}
    for key, val in metrics.items():
        name = key.split("{", 1)[0]
        if name in names:
            out[names[name]] += val
        elif name == SPEC_PER_POS:
            m = _LABEL.search(key)
            if m:
                pos = int(m.group(1))
                out["per_pos"][pos] = out["per_pos"].get(pos, 0.0) + val
    return out


def spec_delta(before: dict, after: dict) -> dict:
    """Counters of one run (after - before) and what vLLM would show for it."""
    d = {k: int(round(after[k] - before[k])) for k in ("drafts", "draft_tokens", "accepted")}
    positions = sorted(set(before["per_pos"]) | set(after["per_pos"]))
    per_pos = [int(round(after["per_pos"].get(p, 0) - before["per_pos"].get(p, 0))) for p in positions]
    drafts = d["drafts"]
    return {**d, "per_pos": per_pos,
            "acceptance_length": 1.0 + d["accepted"] / drafts if drafts else None,
            "per_position_rate": [a / drafts for a in per_pos] if drafts else [],
            "draft_token_acceptance": d["accepted"] / d["draft_tokens"] if d["draft_tokens"] else None}


def metrics_url_for(base_url: str) -> str:
    root = base_url.rstrip("/")
    root = root[:-3] if root.endswith("/v1") else root
    return root + "/metrics"


async def _served_model(base_url: str, timeout: float) -> str:
    from .client import make_openai_client

    client = make_openai_client(base_url, api_key="EMPTY", concurrency=1)
    try:
        async with asyncio.timeout(min(timeout, 60)):
            models = await client.models.list()
    except Exception as e:  # unreachable / not an OpenAI server: one line
        raise PipelineError(f"cannot list the models of {base_url}: {type(e).__name__}: {e}") from None
    finally:
        await client.close()
    if not models.data:
        raise PipelineError(f"{base_url} serves no model")
    return models.data[0].id


async def _run_prompts(base_url: str, model: str, prompts: list, concurrency: int,
                       sampling: dict, timeout: float, prog: Progress | None) -> dict:
    """All prompts with `concurrency` in flight, through 01b's client (openai SDK, retries on
    transient errors); output tokens = the generated token ids vLLM returns."""
    from .client import ChatClient

    sem = asyncio.Semaphore(concurrency)
    tokens, errors, latencies = [0], [], []
    extra = dict(sampling.get("extra_body") or {})
    params = {k: v for k, v in sampling.items() if k != "extra_body"}

    async with ChatClient([base_url], model, timeout=timeout, max_retries=2, concurrency=concurrency) as client:
        async def one(p):
            async with sem:
                res = await client.complete(client.body(p.messages, params, extra_body=extra))
            if not res.ok:
                errors.append(f"{p.id}: {res.error.get('error_type')}: {res.error.get('message')}")
                if prog:
                    prog.update(1, errors=1)
                return
            latencies.append(res.latency_s)
            n = len(res.answer["token_ids"])
            tokens[0] += n
            if prog:
                prog.update(1, tokens=n)

        t0 = time.perf_counter()
        await asyncio.gather(*(one(p) for p in prompts))
        wall = time.perf_counter() - t0
    if len(errors) == len(prompts):
        raise PipelineError(f"every request to {base_url} failed; first: {errors[0]}")
    lat = sorted(latencies)
    return {"concurrency": concurrency, "requests": len(prompts) - len(errors), "errors": len(errors),
            "error_samples": errors[:3], "completion_tokens": tokens[0], "wall_s": round(wall, 3),
            "output_tok_s": tokens[0] / wall if wall > 0 else 0.0,
            "req_s": (len(prompts) - len(errors)) / wall if wall > 0 else 0.0,
            "latency_p50_s": lat[len(lat) // 2] if lat else None}



def bench_server(base_url: str, prompts: list, levels: Sequence[int], sampling: dict, *,
                 arm: str, timeout: float = 600, warmup: int = 2, log_path: Path | None = None) -> dict:
    """Run the prompts at each concurrency level against one server, reading the spec-decode
    counters around each level. Warm-up requests (not counted) go first."""
    from .vllm_server import scrape_metrics

    murl = metrics_url_for(base_url)

    def counters():
        try:
            return spec_counters(scrape_metrics(murl))
        except OSError as e:
            raise PipelineError(f"cannot read {murl}: {e}") from None

    model = asyncio.run(_served_model(base_url, timeout))
    if warmup:
        asyncio.run(_run_prompts(base_url, model, prompts[:warmup], warmup, sampling, timeout, None))
    out = []
    for c in levels:
        before = counters()
        with Progress(f"05 {arm} c={c}", len(prompts), log_path=log_path, unit="req") as prog:
            res = asyncio.run(_run_prompts(base_url, model, prompts, c, sampling, timeout, prog))
        res["spec"] = spec_delta(before, counters())
        out.append(res)
    total = {k: sum(r["spec"][k] for r in out) for k in ("drafts", "draft_tokens", "accepted")}
    per_pos = [sum(v) for v in zip(*(r["spec"]["per_pos"] for r in out))] if out else []
    zero = {"drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0, "per_pos": {}}
    spec = spec_delta(zero, {**{k: float(v) for k, v in total.items()},
                             "per_pos": {i: float(v) for i, v in enumerate(per_pos)}})
    return {"arm": arm, "base_url": base_url, "model": model, "levels": out, "spec": spec}


def run_arm(arm: str, *, target: Path, draft_dir: Path, k: int, ngram: tuple[int, int],
            prompts: list, levels: Sequence[int], sampling: dict, url: str | None,
            server_kwargs: dict, log_dir: Path, timeout: float) -> dict:
    """One arm: against `url` if given, else a server of our own started and stopped here."""
    from .vllm_server import VllmServer, server_command

    spec = spec_config(arm, draft_dir, k, ngram)
    log_path = log_dir / "progress.log"
    if url:
        res = bench_server(url, prompts, levels, sampling, arm=arm, timeout=timeout, log_path=log_path)
        res["server"] = "connected"
    else:
        srv = VllmServer(target, log_path=log_dir / f"vllm-{arm}.log", speculative_config=spec,
                         **server_kwargs)
        print(f"[05] starting vLLM for arm {arm}: {srv.command_line()}", flush=True)
        with srv:
            res = bench_server(srv.base_url, prompts, levels, sampling, arm=arm, timeout=timeout,
                               log_path=log_path)
        res["server"] = "started"
        res["command"] = srv.cmd
    drafts = res["spec"]["drafts"]
    if spec is None and drafts:
        raise PipelineError(f"arm none: the server at {res['base_url']} speculates ({drafts} drafts); "
                            "point --url none=... at a server without --speculative-config")
    if spec is not None and not drafts:
        cmd = " ".join(server_command(str(target), 8000, speculative_config=spec, cpu=False))
        raise PipelineError(f"arm {arm}: vLLM at {res['base_url']} made no drafts (spec-decode "
                            f"counters did not move); start it as: {cmd}")
    res["speculative_config"] = spec
    return res


# ----------------------------------------------------------------------------- report

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
    return {"stage": STAGE, "k": run["k"], "draft": run["draft"]["path"], "target": run["target"]["name_or_path"],
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
        lines.append(f"| offline ({off['samples']} {which}samples) | {off['acceptance_length']:.3f} | "
                     + " | ".join(f"{x:.3f}" for x in off["cumulative"]) + " |")
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
    ax1.set(xlabel="draft position", ylabel="P(accepted up to here)", ylim=(0, 1),
            title="per-position acceptance")
    ax1.set_xticks(xs)
    if series:
        ax1.legend()
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


# ----------------------------------------------------------------------------- the run record

def check_run(out: Path, run: dict) -> None:
    """A rerun must have the same settings and inputs as the run whose parts are on disk."""
    path = out / RUN
    if not path.exists():
        atomic_write_json(path, run)
        return
    old = json.loads(path.read_text())
    for key in sorted(set(old) | set(run)):
        if old.get(key) != run.get(key):
            a, b = json.dumps(old.get(key), sort_keys=True), json.dumps(run.get(key), sort_keys=True)
            raise PipelineError(f"{out} holds an evaluation with other {key} ({a[:160]}) than this run "
                                f"({b[:160]}); rerun with the same settings to resume, or pass "
                                "--overwrite to move the old output aside")


def load_part(path: Path) -> dict | None:
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        return None  # written atomically, so this is foreign damage: redo the part


def parse_urls(items: Sequence[str], base_url: str | None) -> dict[str, str]:
    """`--url ARM=URL` (repeatable) and `--base-url URL` (= eagle3=URL) -> {arm: url}."""
    urls = {}
    for item in items:
        arm, sep, url = item.partition("=")
        if not sep or arm not in ARMS:
            raise PipelineError(f"--url {item!r}: expected ARM=URL with ARM one of {', '.join(ARMS)}")
        urls[arm] = url
    if base_url:
        urls["eagle3"] = base_url
    return urls


def move_aside(out: Path) -> Path | None:
    """--overwrite: the previous output goes to <out>/replaced-<time>/, never deleted."""
    from .store import move_aside as move

    aside = move(out)
    if aside:
        print(f"[05] --overwrite: moved the previous output to {aside}", flush=True)
    return aside
