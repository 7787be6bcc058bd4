"""04's data: the fixed by-id split, packing samples into batches of at most
`max_tokens_per_batch` tokens (one [1, total] sequence with document ids, as speculators' forward
takes them; a sample longer than that gets a batch of its own, whole, so every supervised token is
trained), and the plan of which batches each step reads. Only `max_sample_tokens`, when set, cuts
samples, and the plan counts what it cuts. The batch order is a pure function of
(seed, epoch), so the data position is (epoch, batches consumed) and a resumed run repeats the
uninterrupted one."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from ..configs.train import TrainConfig
from ..errors import PipelineError
from ..hidden_checks import read_sample


def split_ids(ids: list[str], lengths: dict[str, int], val_fraction: float,
              val_max: int | None) -> tuple[list[str], list[str], int]:
    """Fixed by-id split (03's rule); at most `val_max` held-out samples validate, the rest of the
    held-out ones go back to training (05 reads the validation ids from 04's manifest, so it never
    evaluates on a sample trained on). Samples too short to train on (fewer than 3 tokens) are
    dropped and counted."""
    from ..split import is_heldout

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


def collate(store, ids: list[str], cap: int | None, aux_index: list[int], pad_to: int | None = None) -> Batch:
    """Load and shift samples (EAGLE-3 pairs the aux state of token j with token j+1, whose
    target distribution is the target's prediction for token j+2), each cut to `cap` shifted
    tokens (None: whole), then pack them; padded to `pad_to` (a multiple of 128), or to the next
    multiple of it when the batch is longer (a sample longer than a batch)."""
    parts = {k: [] for k in ("aux", "ids", "pos", "doc", "last", "tk", "tl", "fid", "fmask", "fdoc", "tofull")}
    s_off = t_off = truncated = 0
    for d, sid in enumerate(ids):
        s = read_sample(store, sid)
        n = len(s.input_ids)
        if cap is not None and n - 1 > cap:
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
    if pad_to and s_off > pad_to:  # whole multiples: flex compiles once per length (dynamic=False)
        pad_to = -(-s_off // pad_to) * pad_to
    pad = (pad_to - s_off) if pad_to and s_off < pad_to else 0
    if pad:
        z = lambda t, v=0: None if t is None else torch.cat([t, t.new_full((pad, *t.shape[1:]), v)])  # noqa: E731
        aux, tok, pos, doc, last, tk, tl = z(aux), z(tok), z(pos), z(doc, -1), z(last), z(tk), z(tl)
    return Batch(aux[None], tok[None], pos[None], doc, last, tk, tl, cat("fid"), cat("fmask"), cat("fdoc"),
                 cat("tofull"), len(ids), s_off, truncated)


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


def make_plan(store, config: TrainConfig, per_step: int, epochs: int | None = None) -> Plan:
    """The split, and each of `epochs` (default --epochs, else 1) epochs' packed batches in their
    order (epoch e's depends only on the seed and e, so a longer plan extends a shorter one)."""
    lengths = {i: store.length(i) for i in store.ids}
    train, val, dropped = split_ids(sorted(store.ids), lengths, config.val_fraction, config.val_max_samples)
    if not train:
        raise PipelineError(f"no training samples in {config.hidden_states} after holding out "
                            f"{len(val)} for validation (--val-fraction {config.val_fraction})")
    cap, max_sample = config.max_tokens_per_batch, config.max_sample_tokens
    epochs = [pack(train, lengths, cap, random.Random(f"{config.seed}:{e}"), max_sample=max_sample)
              for e in range(epochs or config.epochs or 1)]
    plan = Plan(train, val, dropped, epochs, per_step,
                {"train": cut_report(train, lengths, max_sample), "val": cut_report(val, lengths, max_sample),
                 "own_batch": sum(shifted(lengths[i], max_sample) > cap for i in train + val),
                 "longest": max(shifted(lengths[i], max_sample) for i in train + val)}, lengths)
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
        self.val_batches = pack(plan.val, {i: store.length(i) for i in plan.val}, self.cap, None,
                                max_sample=self.max_sample)

    def step(self, step: int) -> list[Batch] | None:
        epoch, in_epoch = self.plan.locate(step)
        if epoch >= len(self.plan.epochs):
            return None
        base = in_epoch * self.plan.per_step
        return [self.collate(self.plan.epochs[epoch][base + a * self.world + self.rank])
                for a in range(self.grad_accum)]

    def collate(self, ids: list[str]) -> Batch:
        return collate(self.store, ids, self.max_sample, self.aux_index, self.pad_to)
