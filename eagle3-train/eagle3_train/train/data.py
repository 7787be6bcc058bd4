"""04's data: the fixed by-id split, packing samples into batches of at most
`max_tokens_per_batch` tokens (one [1, total] sequence with document ids, as speculators' forward
takes them; a sample longer than that gets a batch of its own, whole, so every supervised token is
trained), and the plan of which batches each step reads. Only `max_sample_tokens`, when set, cuts
samples, and the plan counts what it cuts. With `window_tokens` a longer training sample is trained
as windows instead (`windows`, `pieces`): each supervised position once per epoch, the draft
attending back only `window_context` positions; validation stays on whole samples. The batch
order is a pure function of (seed, epoch), so the data position is (epoch, batches consumed) and
a resumed run repeats the uninterrupted one."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from eagle3_train.common.errors import PipelineError
from eagle3_train.common.hidden_checks import read_sample
from eagle3_train.train.config import TrainConfig


def split_ids(ids: list[str], lengths: dict[str, int], val_fraction: float,
              val_max: int | None) -> tuple[list[str], list[str], int]:
    """Fixed by-id split (03's rule); at most `val_max` held-out samples validate, the rest of the
    held-out ones go back to training (05 reads the validation ids from 04's manifest, so it never
    evaluates on a sample trained on). Samples too short to train on (fewer than 3 tokens) are
    dropped and counted."""
    from eagle3_train.common.split import is_heldout

    usable = [i for i in ids if lengths[i] >= 3]
    val = [i for i in usable if is_heldout(i, val_fraction)]
    if val_max is not None:
        val = val[:val_max]
    held = set(val)
    train = [i for i in usable if i not in held]
    return train, val, len(ids) - len(usable)


def pack(ids: list[str], lengths: dict[str, int], cap: int, rng: random.Random | None,
         window: int = 1024, max_sample: int | None = None) -> list[list[str]]:
    """Batches of at most `cap` (shifted) tokens, a longer sample alone in its own (each sample
    counts as at most `max_sample` tokens): shuffle (when rng), then first-fit decreasing within
    windows of `window` samples, then shuffle the batches. Deterministic given rng."""
    order = list(ids)
    if rng is not None:
        rng.shuffle(order)
    batches: list[list[str]] = []
    for a in range(0, len(order), window):
        bins: list[list] = []  # [free, ids]
        for sid in sorted(order[a: a + window], key=lambda i: -lengths[i]):
            n = shifted(lengths[sid], max_sample)
            for b in bins:
                if b[0] >= n:
                    b[0] -= n
                    b[1].append(sid)
                    break
            else:
                bins.append([max(cap - n, 0), [sid]])
        batches += [b[1] for b in bins]
    if rng is not None:
        rng.shuffle(batches)
    return batches


def shifted(length: int, max_sample: int | None) -> int:
    """A sample's shifted tokens in a batch: all of them, or `max_sample` when it cuts."""
    return length - 1 if max_sample is None else min(length - 1, max_sample)


def cut_report(ids: list[str], lengths: dict[str, int], max_sample: int | None) -> dict:
    """What `max_sample` cuts of `ids`: samples, their lost (shifted) tokens and that share."""
    total = sum(lengths[i] - 1 for i in ids)
    lost = sum(lengths[i] - 1 - shifted(lengths[i], max_sample) for i in ids)
    return {"samples": sum(shifted(lengths[i], max_sample) < lengths[i] - 1 for i in ids),
            "tokens": lost, "token_share": lost / total if total else 0.0, "max_sample_tokens": max_sample}


def windows(length: int, n: int, c: int) -> list[tuple[int, int, int]]:
    """A sample of `length` tokens as windows over its draft positions 1..length-1 (position t reads
    the aux state of token t-1 and token t): (start, stop, loss_from), the positions [start, stop)
    the draft attends to, of which [loss_from, stop) carry the loss, [start, loss_from) being up to
    `c` positions of context. The loss ranges tile 1..length-1, each `n` long (the last shorter);
    a sample of at most `n` positions is one window."""
    out = []
    for lo in range(1, length, n):
        out.append((max(1, lo - c), min(lo + n, length), lo))
    return out


def pieces(ids: list[str], lengths: dict[str, int], n: int, c: int, lookahead: int,
           max_sample: int | None = None) -> tuple[list[tuple], dict[tuple, int]]:
    """`ids` as windows (a sample cut to `max_sample` first): pieces (sid, a, b, loss_from, loss_to),
    the tokens [a, b) of sample sid whose draft positions [loss_from, loss_to) carry the loss, and
    their lengths in tokens. `lookahead` (the draft's steps) tokens past a window's loss range come with it,
    unsupervised, so its last positions' later steps still have their input and target tokens."""
    out, sizes = [], {}
    for sid in ids:
        length = shifted(lengths[sid], max_sample) + 1
        for start, stop, loss_from in windows(length, n, c):
            p = (sid, start - 1, min(stop + lookahead, length), loss_from, stop)
            out.append(p)
            sizes[p] = p[2] - p[1]
    return out, sizes


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
    live: torch.Tensor | None = None  # [T] whether a draft here carries loss (None: all; False: window context)
    targets: torch.Tensor | None = None  # [S, K] target logits over the draft vocab
    ref: torch.Tensor | None = None  # [T] target's greedy token for position t+1
    rows: list = field(default_factory=list)  # per step: shifted positions with a valid target
    spans: list | None = None  # [(start, end)] groups of whole samples run as separate forwards (None: one)

    def to(self, device, dtype) -> Batch:
        """On `device`; the hidden states (aux, last) in `dtype`."""
        def f(t, cast=False):
            return None if t is None else t.to(device, dtype=dtype if cast else None, non_blocking=True)

        return Batch(f(self.aux, True), f(self.ids), f(self.pos), f(self.doc), f(self.last, True),
                     f(self.topk_ids), f(self.topk_lp), f(self.full_ids), f(self.full_mask), f(self.full_doc),
                     f(self.to_full), self.n_docs, self.tokens, self.truncated, f(self.live))


def collate(store, ids: list, cap: int | None, aux_index: list[int], pad_to: int | None = None) -> Batch:
    """Load and shift samples (EAGLE-3 pairs the aux state of token j with token j+1, whose
    target distribution is the target's prediction for token j+2), each cut to `cap` shifted
    tokens (None: whole), or windows of them (pieces: cut already), then pack them; padded to
    `pad_to` (a multiple of 128), or to the next multiple of it when the batch is longer (a sample
    longer than a batch)."""
    parts = {k: [] for k in ("aux", "ids", "pos", "doc", "last", "tk", "tl", "fid", "fmask", "fdoc", "tofull",
                             "live")}
    s_off = t_off = truncated = 0
    for d, item in enumerate(ids):
        sid, a, n, live = (item, 0, None, None) if isinstance(item, str) else (item[0], item[1], item[2], item[3:])
        s = read_sample(store, sid)
        if n is None:
            n = len(s.input_ids)
            if cap is not None and n - 1 > cap:
                n, truncated = cap + 1, truncated + 1
        aux = s.aux[a:n] if aux_index == list(range(s.aux.shape[1])) else s.aux[a:n, aux_index]
        parts["aux"].append(aux[:-1].flatten(1))
        parts["ids"].append(s.input_ids[a + 1:n])
        # the sample's own positions: a window's draft sees the rope angles serving would
        parts["pos"].append(torch.arange(a + 1, n))
        parts["doc"].append(torch.full((n - a - 1,), d))
        if s.last is not None:
            parts["last"].append(s.last[a + 1:n])
        if s.topk_ids is not None:
            parts["tk"].append(s.topk_ids[a + 1:n])
            parts["tl"].append(s.topk_logprobs[a + 1:n])
        parts["fid"].append(s.input_ids[a:n])
        parts["fmask"].append(s.loss_mask[a:n])
        fdoc = torch.full((n - a,), d)
        fdoc[0] = -1
        parts["fdoc"].append(fdoc)
        t = torch.arange(a, n)
        parts["live"].append(torch.ones(n - a, dtype=torch.bool) if live is None else (t >= live[0]) & (t < live[1]))
        parts["tofull"].append(torch.arange(1, n - a) + t_off)
        s_off += n - a - 1
        t_off += n - a
    cat = lambda k: torch.cat(parts[k]) if parts[k] else None  # noqa: E731
    aux, tok, pos, doc = cat("aux"), cat("ids"), cat("pos"), cat("doc")
    last, tk, tl = cat("last"), cat("tk"), cat("tl")
    if pad_to and s_off > pad_to:  # whole multiples: flex compiles once per length (dynamic=False)
        pad_to = -(-s_off // pad_to) * pad_to
    pad = (pad_to - s_off) if pad_to and s_off < pad_to else 0
    if pad:
        z = lambda t, v=0: None if t is None else torch.cat([t, t.new_full((pad, *t.shape[1:]), v)])  # noqa: E731
        aux, tok, pos, doc, last, tk, tl = z(aux), z(tok), z(pos), z(doc, -1), z(last), z(tk), z(tl)
    return Batch(aux[None], tok[None], pos[None], doc, last, tk, tl, cat("fid"), cat("fmask"), cat("fdoc"),
                 cat("tofull"), len(ids), s_off, truncated,
                 None if all(isinstance(i, str) for i in ids) else cat("live"))


@dataclass
class Plan:
    train: list[str]
    val: list[str]
    dropped: int
    epochs: list[list[list[str]]]  # per epoch: its packed batches
    per_step: int  # batches per optimizer step (world x grad_accum)
    cut: dict = field(default_factory=dict)  # what --max-sample-tokens cuts (cut_report), train and val
    lengths: dict = field(default_factory=dict)  # every sample's length

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


def train_units(train: list[str], lengths: dict[str, int], config: TrainConfig) -> tuple[list, dict, int | None]:
    """What batches pack: the training samples, or their windows (--window-tokens); their sizes, and
    the --max-sample-tokens cut pack still applies (None for windows: cut already)."""
    if not config.window_tokens:
        return train, lengths, config.max_sample_tokens
    # The lookahead is the draft's steps: TTT steps, or a block draft's mask slots (block - 1).
    units, sizes = pieces(train, lengths, config.window_tokens, config.context_tokens, config.draft_steps,
                          config.max_sample_tokens)
    return units, sizes, None


def cut_summary(train: list[str], val: list[str], lengths: dict, units: list, sizes: dict, cut: int | None,
                config: TrainConfig) -> dict:
    """Plan.cut: what --max-sample-tokens cuts of train and val, the batches of their own, the longest."""
    cap, max_sample = config.max_tokens_per_batch, config.max_sample_tokens
    return {"train": cut_report(train, lengths, max_sample), "val": cut_report(val, lengths, max_sample),
            "own_batch": sum(shifted(sizes[u], cut) > cap for u in units)
            + sum(shifted(lengths[i], max_sample) > cap for i in val),
            "windows": len(units) if config.window_tokens else None,
            "longest": max(shifted(lengths[i], max_sample) for i in train + val)}


def make_plan(store, config: TrainConfig, per_step: int, epochs: int | None = None) -> Plan:
    """The split, and each of `epochs` (default --epochs, else 1) epochs' packed batches in their
    order (epoch e's depends only on the seed and e, so a longer plan extends a shorter one)."""
    lengths = {i: store.length(i) for i in store.ids}
    train, val, dropped = split_ids(sorted(store.ids), lengths, config.val_fraction, config.val_max_samples)
    if not train:
        raise PipelineError(f"no training samples in {config.hidden_states} after holding out "
                            f"{len(val)} for validation (--val-fraction {config.val_fraction})")
    cap = config.max_tokens_per_batch
    units, sizes, cut = train_units(train, lengths, config)
    epochs = [pack(units, sizes, cap, random.Random(f"{config.seed}:{e}"), max_sample=cut)
              for e in range(epochs or config.epochs or 1)]
    plan = Plan(train, val, dropped, epochs, per_step, cut_summary(train, val, lengths, units, sizes, cut, config),
                lengths)
    if plan.steps_in(0) == 0:
        raise PipelineError(f"{len(train)} training samples make {len(epochs[0])} batches of "
                            f"{cap} tokens, fewer than one step needs ({per_step} = processes x "
                            "--grad-accum); lower --max-tokens-per-batch or add data")
    return plan


class Loader:
    """This process's batches: for a training step its `grad_accum` micro-batches (rank r reads
    every world-th batch of the step's share), for validation the fixed held-out batches."""

    def __init__(self, store, plan: Plan, config: TrainConfig, aux_index: list[int], rank: int, world: int,
                 attn: str):
        self.store, self.plan, self.aux_index, self.rank, self.world = store, plan, aux_index, rank, world
        self.cap, self.grad_accum = config.max_tokens_per_batch, config.grad_accum
        self.max_sample = config.max_sample_tokens
        # Flex attention's block masks (and compiled kernels) want one fixed length, a multiple of
        # 128 (a batch holding one longer sample gets its own, see collate).
        self.pad_to = -(-self.cap // 128) * 128 if attn == "flex" else None
        self.val_batches = pack(plan.val, plan.lengths, self.cap, None, max_sample=self.max_sample)

    def step(self, step: int) -> list[Batch] | None:
        epoch, in_epoch = self.plan.locate(step)
        if epoch >= len(self.plan.epochs):
            return None
        base = in_epoch * self.plan.per_step
        return [self.collate(self.plan.epochs[epoch][base + a * self.world + self.rank])
                for a in range(self.grad_accum)]

    def collate(self, ids: list[str]) -> Batch:
        return collate(self.store, ids, self.max_sample, self.aux_index, self.pad_to)
