"""04's training loop: EAGLE-3 draft training on the 02 store and the 03 vocab mapping.

One optimizer step consumes `world_size x grad_accum` packed batches of at most
`max_tokens_per_batch` tokens each (samples packed into one [1, total] sequence with document ids,
as speculators' forward takes them). The batch order is a pure function of (seed, epoch), so the
data position is (epoch, batches consumed) and a resumed run repeats the uninterrupted one.

Run directory:
  run.json                   resolved config + input identities (a rerun must match, or --overwrite)
  checkpoints/step-XXXXXXX/  weights.pt (trainable tensors), optimizer.pt, trainer.pt (scheduler,
                             loop state, metric accumulators), rng/rank-R.pt, state.json, COMPLETE
                             (written in a temp dir, renamed into place: valid only with COMPLETE)
  metrics.jsonl              train / val / checkpoint / resume records (the last record of a
                             kind and step wins: steps redone after a resume are logged again)
  progress.log, curves.png, export/ (speculators format), manifest.json (written last)
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import errno
import functools
import io
import json
import os
import random
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from .acceptance import chain_acceptance, draft_correctness, empty, flatten, merge, summarize, unflatten
from .draft import unroll
from .errors import PipelineError
from .manifest import (MANIFEST, describe_target, manifest_identity, read_manifest,
                       require_match, text_config)
from .store import TMP_PREFIX, JsonlWriter, atomic_dir_commit, atomic_write_bytes, atomic_write_json, read_jsonl

STAGE = "04_train"
RUN = "run.json"
METRICS = "metrics.jsonl"
CKPT_DIR = "checkpoints"
COMPLETE = "COMPLETE"
EXPORT = "export"
# Settings that may change between a run and its resumption without changing the trajectory
# (input directories may move: their manifests' hashes are compared instead).
RESUMABLE = {"save_every", "keep_last", "log_every", "progress_every", "overwrite", "export_from",
             "quiet", "threads", "out", "hidden_states", "vocab_mapping"}
TARGET_KEYS = ("model_type", "num_hidden_layers", "hidden_size", "vocab_size")


# ----------------------------------------------------------------------------- distributed

@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world > 1:
            torch.distributed.barrier()

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            t = t.clone()
            torch.distributed.all_reduce(t)
        return t


def setup_dist(device: str) -> Dist:
    """torchrun sets RANK/WORLD_SIZE/LOCAL_RANK (multi-node included); plain python = 1 process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise PipelineError("--device cuda was asked for, but no CUDA device is available")
    dev = torch.device("cuda", local) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(dev)
    d = Dist(rank, world, local, dev)
    if world > 1 and not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if use_cuda else "gloo",
                                             timeout=_dt.timedelta(minutes=30))
    return d


# ----------------------------------------------------------------------------- inputs

@dataclass
class Inputs:
    store: object  # hidden_store.HiddenStates
    mapping: object  # vocab.VocabMapping
    target: str
    target_cfg: object
    aux_ids: list[int]  # what the draft reads (a subset of the store's)
    aux_index: list[int]  # their positions in the store's aux axis
    topk: bool


def _identity(desc: dict | None) -> dict:
    return {k: (desc or {}).get(k) for k in TARGET_KEYS}


def open_inputs(args, dtype: torch.dtype = torch.float32) -> Inputs:
    from . import vocab
    from .hidden_store import HiddenStates

    store = HiddenStates(Path(args.hidden_states), dtype=dtype)
    mapping = vocab.read_mapping(Path(args.vocab_mapping))
    target_cfg = vocab.load_target_config(args.target)
    tc = text_config(target_cfg)
    ours = _identity(describe_target(target_cfg, args.target))
    sm, mm = store.manifest, mapping.manifest
    require_match("target model", ours, _identity(sm.get("target")), source=str(store.directory))
    require_match("target model", ours, _identity(mm.get("target")), source=str(args.vocab_mapping))
    fp = lambda m: (m.get("tokenizer") or {}).get("fingerprint")  # noqa: E731
    if fp(sm) != fp(mm):
        raise PipelineError(f"tokenizer fingerprint mismatch: {store.directory} was made with "
                            f"{fp(sm)!r}, but {args.vocab_mapping} with {fp(mm)!r}")
    require_match("target vocab size", tc.vocab_size, int(mapping.target_vocab_size),
                  source=str(args.vocab_mapping))
    require_match("hidden size", tc.hidden_size, store.hidden_size, source=str(store.directory))
    layer_ids = store.layer_ids
    require_match("last layer id", tc.num_hidden_layers, layer_ids[-1], source=str(store.directory))
    stored_aux = list(sm.get("aux_layer_ids") or layer_ids[:-1])
    aux_ids = _aux_ids(args.aux_layer_ids, stored_aux, tc.num_hidden_layers, store.directory)
    missing = [i for i in aux_ids if i not in stored_aux]
    if missing:
        raise PipelineError(f"layer ids mismatch: {store.directory} holds aux layers {stored_aux}, "
                            f"but the draft config asks for {aux_ids}")
    if not store.ids:
        raise PipelineError(f"{store.directory} holds no samples")
    check_shards(store.directory)
    first = read_sample(store, store.ids[0])
    if first.last is None and first.topk_ids is None:
        raise PipelineError(f"{store.directory} has neither last hidden states nor top-k targets")
    topk = first.last is None  # 02's compact option keeps the target's top-k instead
    # A local target is recorded by absolute path (the export's verifier.name_or_path).
    target = str(Path(args.target).resolve()) if Path(args.target).exists() else args.target
    return Inputs(store, mapping, target, target_cfg, aux_ids,
                  [stored_aux.index(i) for i in aux_ids], topk)


def _aux_ids(asked, stored: list[int], num_layers: int, where) -> list[int]:
    """The draft's aux layers in the order vLLM gathers them (ascending, each once): --aux-layer-ids
    is checked like 02's --layers; a store with a repeated id (an older 02's small-target default)
    is refused, since vLLM would hand the draft fewer states than its fc expects."""
    from .extract import check_layers

    if asked:
        return check_layers(list(asked), num_layers, flag="--aux-layer-ids")
    if len(set(stored)) != len(stored) or 0 in stored:
        raise PipelineError(f"{where} holds aux layers {stored}, which vLLM cannot serve (a repeat or id 0: "
                            f"it gathers layers 1..N, each once); re-run 02 or pass --aux-layer-ids "
                            f"{','.join(str(i) for i in sorted(set(stored) - {0}))}")
    if stored != sorted(stored):
        print(f"{where} holds aux layers {stored}; the draft reads them as {sorted(stored)} "
              "(vLLM gathers them in ascending order)")
    return sorted(stored)


def check_shards(directory: Path) -> None:
    """Cheap pre-flight: every committed shard is there with the size its index line recorded
    (a truncated copy is refused before training, not hours into it). Contents are checked as
    samples are read (`read_sample`)."""
    from .hidden_store import committed_shards

    for e in committed_shards(directory).values():
        path = Path(directory) / e["shard"]
        size = path.stat().st_size if path.exists() else None
        if size is None or (e.get("bytes") is not None and size != e["bytes"]):
            what = "is missing" if size is None else f"has {size} bytes, its index line says {e['bytes']}"
            raise PipelineError(f"shard {e['shard']} of {directory} {what} (truncated or replaced); "
                                "rerun 02 with --validate / --repair")


def _shard_of(store, sid: str) -> str:
    return getattr(store, "_where", {}).get(sid, ("?",))[0]


def read_sample(store, sid: str):
    """One sample, with unreadable or non-finite features refused naming the sample and shard."""
    try:
        s = store.get(sid)
    except PipelineError:
        raise
    except Exception as e:  # safetensors raises its own types for damaged data
        raise PipelineError(f"cannot read sample {sid} from shard {_shard_of(store, sid)} of {store.directory}: "
                            f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    for name in ("aux", "last", "topk_logprobs"):
        t = getattr(s, name)
        if t is not None and not bool(torch.isfinite(t).all()):
            raise PipelineError(f"sample {sid} in shard {_shard_of(store, sid)} of {store.directory} has "
                                f"NaN/inf in {name}; rerun 02 with --validate / --repair")
    return s


# ----------------------------------------------------------------------------- data

def split_ids(ids: list[str], lengths: dict[str, int], val_fraction: float,
              val_max: int | None) -> tuple[list[str], list[str], int]:
    """Fixed by-id split (03's rule, so 05 can find the held-out samples again); samples too short
    to train on (fewer than 3 tokens) are dropped and counted."""
    from .vocab import is_heldout

    usable = [i for i in ids if lengths[i] >= 3]
    val = [i for i in usable if is_heldout(i, val_fraction)]
    if val_max is not None:
        val = val[:val_max]
    held = set(val)
    train = [i for i in usable if i not in held and not is_heldout(i, val_fraction)]
    return train, val, len(ids) - len(usable)


def pack(ids: list[str], lengths: dict[str, int], cap: int, rng: random.Random | None,
         window: int = 1024) -> list[list[str]]:
    """Batches of at most `cap` (shifted) tokens: shuffle (when rng), then first-fit decreasing
    within windows of `window` samples, then shuffle the batches. Deterministic given rng."""
    order = list(ids)
    if rng is not None:
        rng.shuffle(order)
    batches: list[list[str]] = []
    for a in range(0, len(order), window):
        bins: list[list] = []  # [free, ids]
        for sid in sorted(order[a: a + window], key=lambda i: -lengths[i]):
            n = min(lengths[sid] - 1, cap)
            for b in bins:
                if b[0] >= n:
                    b[0] -= n
                    b[1].append(sid)
                    break
            else:
                bins.append([cap - n, [sid]])
        batches += [b[1] for b in bins]
    if rng is not None:
        rng.shuffle(batches)
    return batches


@dataclass
class Batch:
    aux: torch.Tensor  # [1, S, n_aux * H]: aux state at shifted position j (token j of the doc)
    ids: torch.Tensor  # [1, S]: the token after it (the draft's input token)
    pos: torch.Tensor  # [1, S]: that token's position in its document
    doc: torch.Tensor  # [S]: document index, -1 = padding
    last: torch.Tensor | None  # [S, H]: target's last hidden state at the input token
    topk_ids: torch.Tensor | None  # [S, k]
    topk_lp: torch.Tensor | None  # [S, k]
    full_ids: torch.Tensor  # [T] the unshifted documents, for acceptance accounting
    full_mask: torch.Tensor  # [T]
    full_doc: torch.Tensor  # [T] doc index, -1 on each document's first token (nothing drafts there)
    to_full: torch.Tensor  # [S_real] position of shifted j in the unshifted frame
    n_docs: int
    tokens: int  # real shifted tokens
    truncated: int = 0
    targets: torch.Tensor | None = None  # [S, K] target logits over the draft vocab
    ref: torch.Tensor | None = None  # [T] target's greedy token for position t+1
    rows: list = field(default_factory=list)  # per step: shifted positions with a valid target

    def to(self, device, dtype) -> Batch:
        """On `device`; the hidden states (aux, last) in `dtype`."""
        def f(t, cast=False):
            return None if t is None else t.to(device, dtype=dtype if cast else None, non_blocking=True)

        return Batch(f(self.aux, True), f(self.ids), f(self.pos), f(self.doc), f(self.last, True),
                     f(self.topk_ids), f(self.topk_lp), f(self.full_ids), f(self.full_mask), f(self.full_doc),
                     f(self.to_full), self.n_docs, self.tokens, self.truncated)


def collate(store, ids: list[str], cap: int, aux_index: list[int], pad_to: int | None = None) -> Batch:
    """Load and shift samples (EAGLE-3 pairs the aux state of token j with token j+1, whose
    target distribution is the target's prediction for token j+2), then pack them."""
    parts = {k: [] for k in ("aux", "ids", "pos", "doc", "last", "tk", "tl", "fid", "fmask", "fdoc", "tofull")}
    s_off = t_off = truncated = 0
    for d, sid in enumerate(ids):
        s = read_sample(store, sid)
        n = len(s.input_ids)
        if n - 1 > cap:
            n, truncated = cap + 1, truncated + 1
        aux = s.aux[:n] if aux_index == list(range(s.aux.shape[1])) else s.aux[:n, aux_index]
        parts["aux"].append(aux[:-1].flatten(1))
        parts["ids"].append(s.input_ids[1:n])
        parts["pos"].append(torch.arange(1, n))
        parts["doc"].append(torch.full((n - 1,), d))
        if s.last is not None:
            parts["last"].append(s.last[1:n])
        if s.topk_ids is not None:
            parts["tk"].append(s.topk_ids[1:n])
            parts["tl"].append(s.topk_logprobs[1:n])
        parts["fid"].append(s.input_ids[:n])
        parts["fmask"].append(s.loss_mask[:n])
        fdoc = torch.full((n,), d)
        fdoc[0] = -1
        parts["fdoc"].append(fdoc)
        parts["tofull"].append(torch.arange(1, n) + t_off)
        s_off += n - 1
        t_off += n
    cat = lambda k: torch.cat(parts[k]) if parts[k] else None  # noqa: E731
    aux, tok, pos, doc = cat("aux"), cat("ids"), cat("pos"), cat("doc")
    last, tk, tl = cat("last"), cat("tk"), cat("tl")
    pad = (pad_to - s_off) if pad_to and s_off < pad_to else 0
    if pad:
        z = lambda t, v=0: None if t is None else torch.cat([t, t.new_full((pad, *t.shape[1:]), v)])  # noqa: E731
        aux, tok, pos, doc, last, tk, tl = z(aux), z(tok), z(pos), z(doc, -1), z(last), z(tk), z(tl)
    return Batch(aux[None], tok[None], pos[None], doc, last, tk, tl, cat("fid"), cat("fmask"), cat("fdoc"),
                 cat("tofull"), len(ids), s_off, truncated)


# ----------------------------------------------------------------------------- objective

def step_weights(spec: str, steps: int) -> list[float]:
    """--ttt-decay: one number g (step k weighs g**k) or a comma list of `steps` weights."""
    try:
        vals = [float(x) for x in str(spec).split(",")]
    except ValueError:
        raise PipelineError(f"--ttt-decay must be a number or a comma list of numbers, not {spec!r}") from None
    if len(vals) == 1:
        return [vals[0] ** k for k in range(steps)]
    if len(vals) != steps:
        raise PipelineError(f"--ttt-decay lists {len(vals)} weights, but --ttt-steps is {steps}")
    return vals


def alignment(b: Batch, steps: int) -> torch.Tensor:
    """valid [K, T]: step k drafting at unshifted t has a supervised target token t+1+k in the same
    document (the shared acceptance accounting decides; predictions do not matter here)."""
    dummy = [b.full_ids] * steps
    return draft_correctness(dummy, b.full_ids, b.full_mask, b.full_ids, b.full_doc)[1]


class Objective(nn.Module):
    """The draft plus its TTT loss: forward KL to the target's distribution over the draft vocab
    (dense target logits, or the stored top-k renormalised over the draft vocab), per-step weights."""

    def __init__(self, draft, steps: int, weights: list[float], loss_impl: str, topk: bool,
                 tgt2draft: torch.Tensor | None):
        super().__init__()
        self.draft = draft
        self.steps = steps
        self.weights = weights
        self.topk = topk
        if tgt2draft is not None:
            self.register_buffer("tgt2draft", tgt2draft, persistent=False)
        else:
            self.tgt2draft = None
        if loss_impl == "fused":
            from speculators.losses.utils import kl_div_loss
        else:
            from speculators.losses.eager import kl_div_loss
        self.kl = kl_div_loss

    def position_loss(self, logits: torch.Tensor, b: Batch, rows: torch.Tensor):
        """Per-position forward KL [n] and which positions count [n] (top-k rows with no mass
        inside the draft vocab do not)."""
        if not self.topk:
            return self.kl(logits[None], b.targets[rows][None])[0], torch.ones_like(rows, dtype=torch.bool)
        ids = b.topk_ids[rows]
        did = self.tgt2draft[ids] if self.tgt2draft is not None else ids
        inside = did >= 0
        p = torch.where(inside, b.topk_lp[rows].float().exp(), 0.0)
        mass = p.sum(-1, keepdim=True)
        p = p / mass.clamp_min(1e-12)
        logq = torch.log_softmax(logits.float(), -1).gather(-1, did.clamp_min(0))
        ent = torch.where(p > 0, p * p.clamp_min(1e-30).log(), 0.0).sum(-1)
        return ent - (p * logq).sum(-1), mass.squeeze(-1) > 0

    def forward(self, b: Batch):
        """(weighted loss, per-step loss sums [K], per-step counts [K], per-step greedy draft ids
        [S] (0 where step k has no target)). The head runs only on the rows that have a target:
        prompt tokens and document ends cost no lm_head."""
        from .draft import head

        total = None
        loss_sum, loss_cnt, preds = [], [], []
        for k, state in enumerate(unroll(self.draft, b.aux, b.ids, b.pos, b.doc, self.steps, states=True)):
            rows = b.rows[k]
            pred = torch.zeros(state.shape[1], dtype=torch.long, device=state.device)
            if rows.numel():
                lg = head(self.draft, state[0, rows])
                per, keep = self.position_loss(lg, b, rows + k)
                n = keep.sum()
                s = (per * keep).sum()
                step_loss = s / n.clamp_min(1)
                loss_sum.append(s.detach().float())
                loss_cnt.append(n.float())
                pred[rows] = lg.detach().argmax(-1)
            else:
                step_loss = head(self.draft, state[0, :1]).sum() * 0.0  # every parameter in the graph (DDP)
                loss_sum.append(torch.zeros((), device=state.device))
                loss_cnt.append(torch.zeros((), device=state.device))
            term = self.weights[k] * step_loss
            total = term if total is None else total + term
            preds.append(pred)
        return total, torch.stack(loss_sum), torch.stack(loss_cnt), preds


def prepare(b: Batch, head, steps: int, to_target: Callable | None = None) -> Batch:
    """Targets and reference tokens from the frozen head (outside the wrapped model, so DDP never
    broadcasts the big lm_head), and the per-step rows that carry a loss."""
    if b.last is not None and head is not None:
        b.targets, ref_s = head.targets(b.last)
    else:
        ref_s = b.topk_ids[:, 0]
    n = b.to_full.shape[0]
    b.ref = torch.full_like(b.full_ids, -1)
    b.ref[b.to_full] = ref_s[:n]
    valid = alignment(b, steps)
    b.rows = [valid[k][b.to_full].nonzero().squeeze(1) for k in range(steps)]
    return b


def acceptance_stats(b: Batch, preds: list[torch.Tensor], to_target: Callable) -> dict:
    """Chain acceptance of the draft's greedy tokens against the target's, through the shared
    accounting (draft_correctness + chain_acceptance)."""
    full = []
    n = b.to_full.shape[0]
    for p in preds:
        f = torch.full_like(b.full_ids, -1)
        f[b.to_full] = to_target(p[:n])
        full.append(f)
    correct, valid = draft_correctness(full, b.full_ids, b.full_mask, b.ref, b.full_doc)
    return chain_acceptance(correct, valid)


# ----------------------------------------------------------------------------- metrics

class Meter:
    """Sums over a log interval (or a validation pass); plain numbers so they can be checkpointed."""

    def __init__(self, steps: int, state: dict | None = None):
        self.steps = steps
        self.s = state or {"loss": 0.0, "n": 0, "loss_sum": [0.0] * steps, "loss_cnt": [0.0] * steps,
                           "tokens": 0, "chain": None, "grad_norm": 0.0}

    def add(self, loss: float, loss_sum: list[float], loss_cnt: list[float], tokens: int, chain: dict,
            grad_norm: float = 0.0) -> None:
        s = self.s
        s["loss"] += loss
        s["n"] += 1
        s["loss_sum"] = [a + b for a, b in zip(s["loss_sum"], loss_sum)]
        s["loss_cnt"] = [a + b for a, b in zip(s["loss_cnt"], loss_cnt)]
        s["tokens"] += tokens
        s["chain"] = chain if s["chain"] is None else merge([s["chain"], chain])
        s["grad_norm"] += grad_norm

    def reduce(self, d: Dist) -> dict:
        """Sums over ranks (every rank must call it)."""
        s = self.s
        chain = merge([s["chain"] or empty(self.steps)])
        counts = flatten(chain)
        flat = [s["loss"], s["n"], s["tokens"], s["grad_norm"], *s["loss_sum"], *s["loss_cnt"], *counts]
        t = d.sum(torch.tensor(flat, dtype=torch.float64, device=d.device)).tolist()
        k = self.steps
        loss, n, tokens, gn = t[:4]
        ls, lc = t[4:4 + k], t[4 + k:4 + 2 * k]
        rates = summarize(unflatten(t[4 + 2 * k:], k))
        # acceptance_length / acc_cum / al_by_depth: vLLM's walk (what it would report);
        # al_all_positions: a draft at every supervised position (higher when acceptance is bursty).
        return {"loss": loss / max(n, 1), "loss_by_step": [a / b if b else None for a, b in zip(ls, lc)],
                "acc_cond": rates["conditional"], "acc_cum": rates["cumulative"],
                "acceptance_length": rates["acceptance_length"], "al_by_depth": rates["al_by_depth"],
                "al_all_positions": rates["al_all_positions"], "acc_cum_all_positions": rates["cumulative_all_positions"],
                "drafts": rates["drafts"], "tokens": int(tokens), "grad_norm": gn / max(n, 1)}


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


def plot_curves(run_dir: Path) -> Path | None:
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
    axes[0, 0].set_title("train loss (forward KL) per TTT step")
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


# ----------------------------------------------------------------------------- checkpoints

def _step_dir(step: int) -> str:
    return f"step-{step:07d}"


def checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """Valid checkpoints (those with COMPLETE), oldest first."""
    root = Path(run_dir) / CKPT_DIR
    out = []
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith("step-") and (p / COMPLETE).exists():
                with contextlib.suppress(ValueError):
                    out.append((int(p.name[5:]), p))
    return sorted(out)


def rng_state(device: torch.device) -> dict:
    st = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if device.type == "cuda":
        st["cuda"] = torch.cuda.get_rng_state(device)
    return st


def set_rng_state(st: dict, device: torch.device) -> None:
    random.setstate(st["python"])
    np.random.set_state(st["numpy"])
    torch.set_rng_state(st["torch"])
    if device.type == "cuda" and "cuda" in st:
        torch.cuda.set_rng_state(st["cuda"], device)


def _save(obj, path: Path) -> None:
    try:
        with open(path, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
    except RuntimeError as e:
        # torch's zip writer reports a short write as "[enforce fail ...] unexpected pos", dropping
        # the OS's ENOSPC; say what happened when the file system is indeed (nearly) full
        if shutil.disk_usage(path.parent).free < 16 << 20:
            raise OSError(errno.ENOSPC, "No space left on device", str(path)) from e
        raise


def save_checkpoint(run_dir: Path, step: int, d: Dist, core: nn.Module, opt, trainer_state: dict,
                    summary: dict, keep_last: int, keep: set[int]) -> Path:
    """Every rank calls this. Rank 0 writes a temp dir, every rank its RNG file, rank 0 marks it
    COMPLETE and renames it into place, then prunes all but the last `keep_last` and `keep`."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    root = Path(run_dir) / CKPT_DIR
    final = root / _step_dir(step)
    tmp = root / f"{TMP_PREFIX}{final.name}"
    msd, osd = get_state_dict(core, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    trainable = {n for n, p in core.named_parameters() if p.requires_grad}
    if d.main:
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "rng").mkdir(parents=True)
    d.barrier()
    # Multi-node runs want --out on shared storage; elsewhere a node's RNG files stay local and
    # a resume there starts those ranks from a fresh RNG (nothing in training draws from it).
    (tmp / "rng").mkdir(parents=True, exist_ok=True)
    _save(rng_state(d.device), tmp / "rng" / f"rank-{d.rank:05d}.pt")
    d.barrier()
    if d.main:
        _save({n: t for n, t in msd.items() if n in trainable}, tmp / "weights.pt")
        _save(osd, tmp / "optimizer.pt")
        _save(trainer_state, tmp / "trainer.pt")
        atomic_write_json(tmp / "state.json", summary)
        (tmp / COMPLETE).write_text(f"step {step}\n")
        atomic_dir_commit(tmp, final)
        for s, p in checkpoints(run_dir)[:-keep_last] if keep_last > 0 else []:
            if s not in keep:
                shutil.rmtree(p, ignore_errors=True)
    d.barrier()
    return final


def relog_checkpoint_records(run_dir: Path, ckpt: Path, step: int, metrics) -> None:
    """A kill between a checkpoint's commit and its `val`/`checkpoint` lines in metrics.jsonl would
    lose them for good (the resumed run starts after that step): write them from the checkpoint's
    own state.json when they are missing."""
    logged = read_metrics(run_dir)
    has = lambda kind: any(r.get("step") == step for r in logged.get(kind, []))  # noqa: E731
    try:
        summary = json.loads((ckpt / "state.json").read_text())
    except (OSError, json.JSONDecodeError):
        return
    if summary.get("val") is not None and not has("val"):
        metrics.write({"kind": "val", "step": step, **summary["val"], "time": summary.get("time")})
    if not has("checkpoint"):
        metrics.write({"kind": "checkpoint", "step": step, "path": str(ckpt), "time": summary.get("time")})


def load_weights(core: nn.Module, path: Path) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    sd = torch.load(path / "weights.pt", map_location="cpu", weights_only=True)
    set_model_state_dict(core, sd, options=StateDictOptions(full_state_dict=True, strict=False))


def load_checkpoint(path: Path, d: Dist, core: nn.Module, opt) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    sd = torch.load(path / "weights.pt", map_location="cpu", weights_only=True)
    osd = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=False)
    set_state_dict(core, opt, model_state_dict=sd, optim_state_dict=osd,
                   options=StateDictOptions(full_state_dict=True, strict=False))
    rng = path / "rng" / f"rank-{d.rank:05d}.pt"
    if rng.exists():
        set_rng_state(torch.load(rng, map_location="cpu", weights_only=False), d.device)
    return torch.load(path / "trainer.pt", map_location="cpu", weights_only=False)


# ----------------------------------------------------------------------------- run config

def run_config(args) -> dict:
    cfg = dict(vars(args))
    for k in ("hidden_states", "vocab_mapping", "out", "target"):
        if k != "target" or Path(cfg[k]).exists():
            cfg[k] = str(Path(cfg[k]).resolve())
    return cfg


def input_identity(inp: Inputs, vocab_mapping: str) -> dict:
    """What a resumed run must find again: the inputs' manifests (by content) and the target."""
    def manifest(d):
        return {"manifest_identity": manifest_identity(d)}

    return {"hidden_states": manifest(inp.store.directory), "vocab_mapping": manifest(vocab_mapping),
            "target": _identity(describe_target(inp.target_cfg, inp.target))}


def check_run(out: Path, cfg: dict, identity: dict) -> str | None:
    """None when `out` is new or holds this run; else the first difference, as one line."""
    path = out / RUN
    if not path.exists():
        return None
    try:
        old = json.loads(path.read_text())
    except json.JSONDecodeError:
        return f"{path} is not valid JSON"
    for k in sorted(set(old.get("config", {})) | set(cfg)):
        if k in RESUMABLE:
            continue
        if old.get("config", {}).get(k) != cfg.get(k):
            return (f"{out} holds a run started with {k}={old['config'].get(k)!r}, this run has "
                    f"{k}={cfg.get(k)!r}; rerun with the same settings to resume, or pass --overwrite "
                    "to move the old run aside")
    for k in sorted(identity):
        if (old.get("inputs") or {}).get(k) != identity[k]:
            return (f"{out} holds a run on other inputs: {k} was {(old.get('inputs') or {}).get(k)!r}, "
                    f"now {identity[k]!r}; pass --overwrite to move the old run aside")
    return None


def move_aside(out: Path) -> Path | None:
    from .store import move_aside as move

    return move(out, (MANIFEST, RUN, METRICS, CKPT_DIR, EXPORT, "curves.png", "progress.log"))


# ----------------------------------------------------------------------------- the run

@dataclass
class Plan:
    train: list[str]
    val: list[str]
    dropped: int
    epochs: list[list[list[str]]]  # per epoch: its packed batches
    per_step: int  # batches per optimizer step (world x grad_accum)
    cut: int = 0  # training samples longer than a batch, cut to its length

    def steps_in(self, e: int) -> int:
        return len(self.epochs[e]) // self.per_step

    @property
    def total_steps(self) -> int:
        return sum(self.steps_in(e) for e in range(len(self.epochs)))

    def locate(self, step: int) -> tuple[int, int]:
        """(epoch, step within epoch) of global step `step`."""
        for e in range(len(self.epochs)):
            if step < self.steps_in(e):
                return e, step
            step -= self.steps_in(e)
        return len(self.epochs), 0


def make_plan(store, args, per_step: int) -> Plan:
    lengths = {i: store.length(i) for i in store.ids}
    train, val, dropped = split_ids(sorted(store.ids), lengths, args.val_fraction, args.val_max_samples)
    if not train:
        raise PipelineError(f"no training samples in {args.hidden_states} after holding out "
                            f"{len(val)} for validation (--val-fraction {args.val_fraction})")
    cap = args.max_tokens_per_batch
    epochs = [pack(train, lengths, cap, random.Random(f"{args.seed}:{e}")) for e in range(args.epochs)]
    plan = Plan(train, val, dropped, epochs, per_step, sum(lengths[i] - 1 > cap for i in train))
    if plan.steps_in(0) == 0:
        raise PipelineError(f"{len(train)} training samples make {len(epochs[0])} batches of "
                            f"{cap} tokens, fewer than one step needs ({per_step} = processes x "
                            "--grad-accum); lower --max-tokens-per-batch or add data")
    return plan


def build(args, inp: Inputs, d: Dist):
    """(draft, head, objective) on the device."""
    from . import draft as D

    device = d.device
    cuda = device.type == "cuda"
    attn = args.attn if args.attn != "auto" else ("flex" if cuda else "sdpa")
    if attn == "flex":
        if not cuda:
            raise PipelineError("--attn flex needs CUDA (flex attention has no CPU backward); use sdpa")
        D.use_compiled_flex()
    loss_impl = args.loss_impl if args.loss_impl != "auto" else ("fused" if cuda else "eager")
    if loss_impl == "fused" and not cuda:
        raise PipelineError("--loss-impl fused needs CUDA (a Triton kernel); use eager")
    d2t = torch.from_numpy(inp.mapping.d2t).long()
    t2d = torch.from_numpy(inp.mapping.t2d).bool()
    weights = D.load_target_weights(inp.target)
    impl = {"flex": "simple_flex_attention", "sdpa": "sdpa", "eager": "eager"}[attn]
    draft = D.build_draft(inp.target, inp.target_cfg, aux_layer_ids=inp.aux_ids, d2t=d2t, t2d=t2d,
                          weights=weights, arch=args.draft_arch, hidden_size=args.draft_hidden_size,
                          intermediate_size=args.draft_intermediate_size, num_layers=args.draft_layers,
                          num_heads=args.draft_heads, num_kv_heads=args.draft_kv_heads,
                          norm_before_residual=args.norm_before_residual,
                          speculative_tokens=args.num_speculative_tokens,
                          train_embeddings=args.train_embeddings, train_lm_head=args.train_lm_head,
                          attn_impl=impl, seed=args.seed)
    draft_ids = t2d.nonzero().squeeze(1) if draft.use_draft_vocab else None
    head_dtype = torch.bfloat16 if cuda else torch.float32
    head = None if inp.topk else D.target_head(inp.target_cfg, weights, draft_ids, device, head_dtype)
    tgt2draft = None
    if inp.topk and draft.use_draft_vocab:
        tgt2draft = torch.full((t2d.shape[0],), -1, dtype=torch.long)
        tgt2draft[draft_ids] = torch.arange(draft_ids.shape[0])
    del weights
    core = Objective(draft, args.ttt_steps, step_weights(args.ttt_decay, args.ttt_steps), loss_impl,
                     inp.topk, tgt2draft).to(device)
    return draft, head, core, {"attn": attn, "loss_impl": loss_impl}


def wrap(core: Objective, args, d: Dist) -> nn.Module:
    if d.world == 1:
        return core
    if args.distributed == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(d.device.type, (d.world,))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if d.device.type == "cuda" else MixedPrecisionPolicy()
        for layer in core.draft.layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(core, mesh=mesh, mp_policy=mp)
        return core
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(core, device_ids=[d.local_rank] if d.device.type == "cuda" else None,
                                   broadcast_buffers=False)


def _grad_norm(params, clip: float) -> float:
    norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)


def evaluate(wrapped, core: Objective, head, batches: list[list[str]], load: Callable[[list[str]], Batch],
             d: Dist, autocast, steps: int, to_target) -> dict:
    """Validation over this rank's share of the fixed validation batches, summed over ranks.
    Every rank runs the same number of forwards (FSDP gathers weights in each), the extra ones
    on a repeated batch that is not counted. Batches are loaded one at a time (a long held-out
    set of a large target does not fit on the device at once)."""
    meter = Meter(steps)
    mine = batches[d.rank::d.world]
    n = -(-len(batches) // d.world)
    was = core.training
    core.eval()
    with torch.no_grad():
        for i in range(n):
            b = prepare(load(mine[i] if i < len(mine) else batches[0]), head, steps)
            with autocast():
                loss, ls, lc, preds = wrapped(b)
            if i < len(mine):
                meter.add(float(loss), ls.tolist(), lc.tolist(), b.tokens, acceptance_stats(b, preds, to_target))
    core.train(was)
    return meter.reduce(d)


def run(args, *, on_step: Callable[[int], None] | None = None) -> dict:
    """Train (or resume), validate, checkpoint, export. Every process of a torchrun calls it."""
    from .store import DirLock, clean_temp_files

    d = setup_dist(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    inp = open_inputs(args, torch.bfloat16 if d.device.type == "cuda" else torch.float32)
    identity = input_identity(inp, args.vocab_mapping)
    cfg = run_config(args)
    lock = DirLock(out, STAGE) if d.main else contextlib.nullcontext()
    with lock:
        if d.main:
            out.mkdir(parents=True, exist_ok=True)
            clean_temp_files(out)
            clean_temp_files(out / CKPT_DIR)
            conflict = check_run(out, cfg, identity)
            if conflict and not args.overwrite:
                raise PipelineError(conflict)
            if conflict and (moved := move_aside(out)):
                print(f"previous run moved to {moved}")
            if not (out / RUN).exists():
                atomic_write_json(out / RUN, {"config": cfg, "inputs": identity})
        d.barrier()
        try:
            return _train(args, d, inp, out, identity, on_step)
        finally:
            if d.world > 1 and torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()


def _train(args, d: Dist, inp: Inputs, out: Path, identity: dict, on_step) -> dict:
    from .draft import export_draft, lr_lambda
    from .manifest import write_manifest
    from .progress import Progress
    from .vocab import SPLIT

    man_path = out / MANIFEST
    if man_path.exists():
        man = read_manifest(out, STAGE)
        if d.main and (out / EXPORT / "config.json").exists():
            print(f"{out} is complete (step {man['counts'].get('steps')}); export: {out / EXPORT}")
        return man
    per_step = d.world * args.grad_accum
    plan = make_plan(inp.store, args, per_step)
    total = min(args.max_steps, plan.total_steps) if args.max_steps else plan.total_steps
    steps = args.ttt_steps
    cuda = d.device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    autocast = functools.partial(torch.autocast, "cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext
    # Flex attention's block masks (and compiled kernels) want one fixed length, a multiple of 128.
    pad_to = -(-args.max_tokens_per_batch // 128) * 128 if (cuda and args.attn in ("auto", "flex")) else None

    draft, head, core, impl = build(args, inp, d)
    to_target = _to_target(draft)
    wrapped = wrap(core, args, d)
    params = [p for p in core.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(args.beta1, args.beta2), weight_decay=args.weight_decay,
                            eps=1e-8, fused=cuda or None)
    warmup = args.warmup_steps if args.warmup_steps is not None else int(args.warmup_ratio * total)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, functools.partial(
        lr_lambda, warmup=warmup, total=total, schedule=args.schedule, min_ratio=args.min_lr_ratio))

    # -- resume
    step, best, meter_state = 0, {"step": None, "acceptance_length": None}, None
    ckpts = checkpoints(out)
    if ckpts:
        path = ckpts[-1][1]
        st = load_checkpoint(path, d, core, opt)
        sched.load_state_dict(st["scheduler"])
        step, best, meter_state = st["step"], st["best"], st.get("meter")
        if st.get("per_step") != per_step and d.main:
            print(f"note: {path.name} was made with {st.get('per_step')} batches per step, this run uses "
                  f"{per_step}; the data order from here differs from the original run")
    else:
        torch.manual_seed(args.seed)
    metrics = JsonlWriter(out / METRICS) if d.main else None
    if metrics and ckpts:
        metrics.write({"kind": "resume", "step": step, "from": ckpts[-1][1].name, "time": time.time()})
        relog_checkpoint_records(out, ckpts[-1][1], step, metrics)
    if d.main:
        n_train = sum(p.numel() for p in params)
        print(f"04_train: {len(plan.train)} train / {len(plan.val)} val samples ({plan.dropped} too short, "
              f"{plan.cut} cut to --max-tokens-per-batch), "
              f"{plan.steps_in(0)} steps/epoch x {args.epochs} epochs -> {total} steps; "
              f"{n_train:,} trainable parameters; device {d.device} x{d.world}; attention {impl['attn']}, "
              f"loss {impl['loss_impl']}; {'top-k' if inp.topk else 'hidden-state'} targets"
              + (f"; resuming at step {step}" if step else ""))
    val_batches = pack(plan.val, {i: inp.store.length(i) for i in plan.val}, args.max_tokens_per_batch, None)

    def load_val(ids: list[str]) -> Batch:
        return collate(inp.store, ids, args.max_tokens_per_batch, inp.aux_index, pad_to).to(d.device, dtype)

    meter = Meter(steps, meter_state)
    progress = Progress("04_train", total, initial=step, log_path=out / "progress.log" if d.main else None,
                        every_s=args.progress_every, unit="step", disable=not d.main or args.quiet)
    pool = ThreadPoolExecutor(1)

    def load(step_: int):
        e, s = plan.locate(step_)
        if e >= len(plan.epochs):
            return None
        base = s * per_step
        return [collate(inp.store, plan.epochs[e][base + a * d.world + d.rank], args.max_tokens_per_batch,
                        inp.aux_index, pad_to) for a in range(args.grad_accum)]

    t_last, cpu_last = time.monotonic(), time.process_time()
    nxt = pool.submit(load, step) if step < total else None
    core.train()
    try:
        while step < total:
            micro = nxt.result()
            nxt = pool.submit(load, step + 1) if step + 1 < total else None
            opt.zero_grad(set_to_none=True)
            tokens, loss_val = 0, 0.0
            ls_tot, lc_tot, chains = None, None, []
            for a, b in enumerate(micro):
                b = prepare(b.to(d.device, dtype), head, steps)
                sync = a + 1 == len(micro) or not hasattr(wrapped, "no_sync")
                ctx = contextlib.nullcontext() if sync else wrapped.no_sync()
                with ctx:
                    with autocast():
                        loss, ls, lc, preds = wrapped(b)
                    (loss / len(micro)).backward()
                loss_val += float(loss.detach()) / len(micro)
                ls_tot = ls if ls_tot is None else ls_tot + ls
                lc_tot = lc if lc_tot is None else lc_tot + lc
                chains.append(acceptance_stats(b, preds, to_target))
                tokens += b.tokens
            gn = _grad_norm(params, args.grad_clip)
            lr = sched.get_last_lr()[0]
            opt.step()
            sched.step()
            step += 1
            meter.add(loss_val, ls_tot.tolist(), lc_tot.tolist(), tokens, merge(chains), gn)
            progress.update(1, tokens=tokens, loss=f"{loss_val:.4f}", lr=f"{lr:.2e}")
            if step % args.log_every == 0 or step == total:
                r = meter.reduce(d)
                now = time.monotonic()
                if d.main:
                    rec = {"kind": "train", "step": step, "epoch": plan.locate(step - 1)[0], "lr": lr,
                           **{k: r[k] for k in ("loss", "loss_by_step", "acc_cond", "acc_cum",
                                                "acceptance_length", "al_all_positions", "tokens", "grad_norm")},
                           "tokens_per_s": r["tokens"] / max(now - t_last, 1e-9),
                           "cpu_s": time.process_time() - cpu_last, "time": time.time()}
                    metrics.write(rec)
                    progress.update(0, al=f"{r['acceptance_length']:.2f}",
                                    acc0=f"{r['acc_cum'][0]:.2f}", tok_s=f"{rec['tokens_per_s']:.0f}")
                meter = Meter(steps)
                t_last, cpu_last = now, time.process_time()
            if step % args.save_every == 0 or step == total:
                v = evaluate(wrapped, core, head, val_batches, load_val, d, autocast, steps, to_target) \
                    if plan.val else None
                if v is not None and _better(v, best):
                    best = {"step": step, "acceptance_length": v["acceptance_length"], "loss": v["loss"]}
                e, s = plan.locate(step)
                state = {"step": step, "best": best, "scheduler": sched.state_dict(), "meter": meter.s,
                         "per_step": per_step, "epoch": e, "batches_in_epoch": s * per_step}
                summary = {"step": step, "epoch": e, "batches_in_epoch": s * per_step, "total_steps": total,
                           "val": v, "best": best, "world_size": d.world, "time": time.time()}
                path = save_checkpoint(out, step, d, core, opt, state, summary, args.keep_last,
                                       {best["step"]} if best["step"] else set())
                if d.main:
                    if v is not None:
                        metrics.write({"kind": "val", "step": step, **v, "time": time.time()})
                        progress.update(0, val_al=f"{v['acceptance_length']:.2f}")
                    metrics.write({"kind": "checkpoint", "step": step, "path": str(path), "time": time.time()})
                t_last, cpu_last = time.monotonic(), time.process_time()
            if on_step is not None:
                on_step(step)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        progress.close("finished" if step >= total else f"stopped at step {step}")
        if metrics:
            metrics.close()

    # -- export: the best checkpoint by validation acceptance, else the last
    pick = best["step"] if args.export_from == "best" and best["step"] else step
    valid = dict(checkpoints(out))
    if pick != step and pick in valid:
        load_weights(core, valid[pick])
    result = {}
    sharded = d.world > 1 and args.distributed == "fsdp"
    full = None
    if sharded:  # gathering the full state is a collective: every rank takes part
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(core, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if d.main:
        export_model = _rebuild_for_export(args, inp, full) if sharded else draft.to("cpu").float()
        info = {"step": pick, "best": best, "total_steps": total, **impl, "args": run_config(args)}
        export_draft(export_model, out / EXPORT, extra=info)
        curves = plot_curves(out)
        last_val = (read_metrics(out).get("val") or [None])[-1]
        val_ids = sorted(plan.val)
        result = write_manifest(
            out, STAGE, config=run_config(args), inputs=identity,
            outputs={"export": str((out / EXPORT).resolve()), "checkpoint": str(valid.get(pick, "")),
                     "curves": str(curves) if curves else None, "metrics": str(out / METRICS)},
            counts={"steps": total, "exported_step": pick, "train_samples": len(plan.train),
                    "val_samples": len(plan.val), "dropped_short": plan.dropped, "cut_long": plan.cut},
            split={"rule": SPLIT.replace("heldout_fraction", "val_fraction"), "val_fraction": args.val_fraction,
                   "val_ids": val_ids},
            best=best, final_val=last_val, target=describe_target(inp.target_cfg, args.target),
            tokenizer=inp.store.manifest.get("tokenizer"), layer_ids=inp.aux_ids,
            draft={"arch": args.draft_arch, "hidden_size": draft.config.transformer_layer_config.hidden_size,
                   "target_hidden_size": draft.config.target_hidden_size,
                   "draft_vocab_size": draft.config.draft_vocab_size})
        print(f"exported step {pick} to {out / EXPORT}"
              + (f" (validation AL {best['acceptance_length']:.3f} with {steps} draft tokens)"
                 if best["acceptance_length"] else ""))
    d.barrier()
    return result


def _better(v: dict, best: dict) -> bool:
    """Higher acceptance length (as vLLM counts it: the walk) wins; on a tie, the lower loss."""
    if best.get("acceptance_length") is None:
        return True
    if v["acceptance_length"] != best["acceptance_length"]:
        return v["acceptance_length"] > best["acceptance_length"]
    return v["loss"] < best.get("loss", float("inf"))


def _to_target(draft):
    from .draft import draft_to_target

    return draft_to_target(draft)


def _rebuild_for_export(args, inp: Inputs, full_sd: dict):
    """Under FSDP the live draft is sharded; rank 0 rebuilds a plain one from the full state."""
    from . import draft as D

    d2t = torch.from_numpy(inp.mapping.d2t).long()
    t2d = torch.from_numpy(inp.mapping.t2d).bool()
    model = D.build_draft(inp.target, inp.target_cfg, aux_layer_ids=inp.aux_ids, d2t=d2t, t2d=t2d,
                          weights=D.load_target_weights(inp.target), arch=args.draft_arch,
                          hidden_size=args.draft_hidden_size, intermediate_size=args.draft_intermediate_size,
                          num_layers=args.draft_layers, num_heads=args.draft_heads,
                          num_kv_heads=args.draft_kv_heads, norm_before_residual=args.norm_before_residual,
                          speculative_tokens=args.num_speculative_tokens,
                          train_embeddings=args.train_embeddings, train_lm_head=args.train_lm_head)
    sd = {k.removeprefix("draft."): v for k, v in full_sd.items() if k.startswith("draft.")}
    model.load_state_dict(sd, strict=False)
    return model.float()
