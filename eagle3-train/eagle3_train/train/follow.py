"""04 --follow: train on a hidden-state store while its producer (02, or 01b's capture mode) still
writes it, and with --consume delete each shard once it is trained, so both ends stay within a disk
bound (02 --max-store-gb).

The data order: the producer's plan.json fixes every shard's samples and lengths before the first
shard exists, so the split (data.split_ids: the held-out rule by id, the same ids as 04 on the
finished store), each shard's packed batches (seeded by the shard) and the number of steps are known
at the start. The batches are the shards' batches in the order 04 takes the shards: the order the
store's index commits them (one index file: its line order; several producer ranks' files: shard
order, which every rank of a torchrun agrees on without talking). Each checkpoint records that
arrival order, and a resume replays it, so a rerun trains the batches the interrupted run did.

Validation: on the held-out ids of the shards the stream has reached by that step (all of them at
the last step, which first waits for every shard); the best checkpoint is chosen only among those
that saw every held-out sample. With --consume the held-out samples of a shard are copied to
OUT/heldout when it is taken (only they: the set is at most --val-max-samples).

Consumption: a checkpoint records the shards whose batches are all trained by its step as consumed;
once it is committed they are deleted (a resume deletes any a kill left). A resume starts from that
step, so it never needs a deleted shard and never trains a sample twice. 04 waiting for a shard while
it holds trained ones checkpoints (without validating) to delete them: the producer may be waiting for
that room. After --follow-timeout seconds without a new shard it checkpoints and stops (FollowTimeout,
exit 75), so a rerun neither retrains a step nor needs a shard it trained. Under torchrun the ranks
decide both together (one all-reduce per poll).

A producer that plans nothing ahead (01b's capture mode: header.json with expected_samples, no
plan.json until its end) is followed open-ended: see follow_open.py.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import random
import threading
import time
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path

import torch

from eagle3_train.common import hidden_store as hs
from eagle3_train.common.errors import PipelineError
from eagle3_train.common.store import clean_temp_files
from eagle3_train.train.config import HELDOUT, STAGE, TrainConfig
from eagle3_train.train.data import Loader, Plan, cut_summary, pack, split_ids, train_units
from eagle3_train.train.follow_open import EXPECTED, OPEN, UNBOUNDED, split_shard
from eagle3_train.train.follow_open import mode as follow_mode

POLL_S = 0.25  # how often a waiting follower looks at the index


class Starved(Exception):
    """No new shard for --follow-timeout seconds, agreed by every rank (the trainer checkpoints,
    then stops with FollowTimeout)."""


class FollowTimeout(PipelineError):
    """04 stopped at --follow-timeout after a checkpoint that holds all it trained: the CLI exits
    EXIT_FOLLOW_TIMEOUT (75), not 2, so a driver can tell "rerun once there is more" from an error."""


def unit_sample(u) -> str:
    return u if isinstance(u, str) else u[0]


def wait_for(get, *, what: str, directory: Path, timeout: float, log_path: Path | None, every_s: float):
    """get() until it is not None, saying so now and then; past `timeout` one clear error line."""
    t0 = last = time.monotonic()
    said = False
    while (found := get()) is None:
        now = time.monotonic()
        if now - t0 > timeout:
            raise PipelineError(f"{what} for {timeout:.0f} s (--follow-timeout): is its producer still running? "
                                f"see {Path(directory) / 'progress.log'}")
        if not said or now - last >= every_s:
            hs.note(log_path, STAGE, f"waiting: {what}")
            said, last = True, now
        time.sleep(POLL_S)
    return found


def read_plan(directory: Path) -> dict | None:
    path = Path(directory) / hs.PLAN
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except json.JSONDecodeError as e:
        raise PipelineError(f"{path} is not valid JSON ({e.msg}); rerun its producer (02)") from None


def open_growing(config: TrainConfig, dtype: torch.dtype) -> hs.GrowingStore:
    """The store to follow, once its producer has written its header (or manifest) and plan."""
    directory = Path(config.hidden_states)
    if not directory.is_dir() and not directory.parent.is_dir():
        raise PipelineError(f"--hidden-states {directory}: neither it nor its parent exists")
    def ready():
        if (header := hs.read_header(directory)) is None:
            return None
        # 02 writes plan.json before header.json: a header alone is a producer that plans nothing ahead
        found = follow_mode(config, directory, header)
        return None if found is None else (header, found)

    header, mode = wait_for(ready, what=f"no {hs.HEADER} in {directory} yet", directory=directory,
                            timeout=config.follow_timeout, log_path=None, every_s=config.progress_every)
    store = hs.GrowingStore(directory, header, dtype=dtype)
    store.follow_mode = mode
    if mode == OPEN:  # the producer's estimate, as its header said it (the manifest does not)
        own = json.loads((directory / hs.HEADER).read_text()) if (directory / hs.HEADER).exists() else header
        store.expected_samples = int(own.get(EXPECTED) or 0)
    return store


def follow_identity(store: hs.GrowingStore) -> dict:
    """What a followed store is for a resume: its format and its plan (the manifest comes too late);
    open-ended, its format alone (its plan.json appears at the producer's end) and the mode."""
    header = hs.read_header(store.directory) or {}
    body = {"header": {k: header.get(k) for k in hs.HEADER_KEYS}}
    if getattr(store, "follow_mode", None) != OPEN:
        body["shards"] = (read_plan(store.directory) or {}).get("shards")
    digest = hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()
    return {"follow_identity": digest} | ({"follow_mode": OPEN} if "shards" not in body else {})


@dataclass
class FollowPlan(Plan):
    """A Plan whose one epoch is the stream of batches, growing as shards are taken; its length is
    known from plan.json from the start."""
    batches_total: int = 0

    def steps_in(self, e: int) -> int:
        return self.batches_total // self.per_step if e == 0 else 0


class FollowLoader(Loader):
    """A Loader whose step waits until the stream holds the step's batches."""

    follow: Follow

    def step(self, step: int):
        need = (step + 1) * self.plan.per_step
        self.follow.ensure(need)
        if self.follow.open and len(self.follow.stream) < need:  # ended: fewer than one more step
            return None
        return super().step(step)


class Follow:
    """The shards of a growing store, taken in arrival order into one stream of batches; what a
    checkpoint records (`state`), a resume replays (`restore`), and --consume deletes (`consume`)."""

    def __init__(self, config: TrainConfig, store: hs.GrowingStore, out: Path, per_step: int, d):
        self.config, self.store, self.out, self.d = config, store, Path(out), d
        self.dir = store.directory
        self.open = getattr(store, "follow_mode", None) == OPEN
        self.ended = False  # open: the producer's manifest seen and every committed shard taken
        self.stream: list = []
        if self.open:
            self.shards, self.batches, self.units, self.sizes = {}, {}, [], {}
            self.train_ids, self.val_ids = set(), set()
            self.plan = FollowPlan([], [], 0, [self.stream], per_step, {}, {}, batches_total=UNBOUNDED)
        else:
            self.planned(config, per_step)
        self.arrivals: list[int] = []  # shards taken, in order
        self.start: dict[int, int] = {}  # shard -> its first batch's position in the stream
        self.replay: list[int] = []  # a resumed run's recorded arrivals, taken first
        self.consumed: set[int] = set()
        self.heldout = self.out / HELDOUT
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.waiting = False
        self.said = 0.0
        self.pending: set[int] = set()  # trained shards the checkpoint being saved consumes
        self.log_path = self.out / "progress.log" if d.main else None
        self.last_new = time.monotonic()
        if config.consume and d.main:
            self.heldout.mkdir(parents=True, exist_ok=True)
            clean_temp_files(self.heldout)

    def planned(self, config: TrainConfig, per_step: int) -> None:
        """plan.json's shards: the split, every shard's batches and the pass's length, known now."""
        plan = read_plan(self.dir)
        self.shards = {int(s["k"]): s for s in plan["shards"]}
        lengths = {}
        for s in plan["shards"]:
            if "lengths" not in s:
                raise PipelineError(f"{self.dir / hs.PLAN} lists no sample lengths (made by an older 02): "
                                    "--follow packs batches from them; let 02 finish and train without --follow, "
                                    "or rerun 02 with --overwrite")
            lengths |= dict(zip(s["ids"], s["lengths"], strict=True))
        train, val, dropped = split_ids(sorted(lengths), lengths, config.val_fraction, config.val_max_samples)
        if not train:
            raise PipelineError(f"no training samples in {self.dir} after holding out {len(val)} for validation "
                                f"(--val-fraction {config.val_fraction})")
        self.train_ids, self.val_ids = set(train), set(val)
        units, sizes, cut = train_units(train, lengths, config)
        by_sample: dict[str, list] = {}
        for u in units:
            by_sample.setdefault(unit_sample(u), []).append(u)
        # Each shard's batches depend on its samples and the seed only: the same in any arrival order.
        self.batches = {k: pack([u for sid in s["ids"] for u in by_sample.get(sid, [])], sizes,
                                config.max_tokens_per_batch, random.Random(f"{config.seed}:shard-{k}"),
                                max_sample=cut)
                        for k, s in self.shards.items()}
        self.plan = FollowPlan(train, val, dropped, [self.stream], per_step,
                               cut_summary(train, val, lengths, units, sizes, cut, config), lengths,
                               batches_total=sum(len(b) for b in self.batches.values()))
        if self.plan.total_steps == 0:
            raise PipelineError(f"{len(train)} training samples make {self.plan.batches_total} batches of "
                                f"{config.max_tokens_per_batch} tokens, fewer than one step needs ({per_step} = "
                                "processes x --grad-accum); lower --max-tokens-per-batch or add data")

    def end_pass(self, step: int) -> int:
        """Open-ended: the producer is done and the stream holds fewer than one more step: the pass is
        `step` steps (what the plan, the cut report and the manifest then say)."""
        cfg, plan = self.config, self.plan
        with self.lock:
            plan.batches_total = len(self.stream)
        if not plan.train:
            raise PipelineError(f"no training samples in {self.dir} after holding out {len(plan.val)} for "
                                f"validation (--val-fraction {cfg.val_fraction})")
        if step == 0:
            raise PipelineError(f"{len(plan.train)} training samples make {len(self.stream)} batches of "
                                f"{cfg.max_tokens_per_batch} tokens, fewer than one step needs ({plan.per_step} = "
                                "processes x --grad-accum); lower --max-tokens-per-batch or add data")
        self.summarize()
        if cfg.consume and self.d.main and len(self.consumed) == len(self.arrivals):
            self.close_heldout()  # a kill came between the last checkpoint and this
        return plan.steps_in(0)

    def summarize(self) -> None:
        """Open-ended: what --max-sample-tokens cuts of what came (the manifest's `cut`)."""
        cfg = self.config
        cut = cfg.max_sample_tokens if not cfg.window_tokens else None
        with self.lock:
            self.plan.cut = cut_summary(self.plan.train, self.plan.val, self.plan.lengths, self.units, self.sizes,
                                        cut, cfg)

    def all_taken(self) -> bool:
        return self.ended if self.open else len(self.arrivals) == len(self.shards)

    # -- arrival

    def next_entry(self) -> dict | None:
        """The next shard to take (its index entry), or None while it is not committed."""
        done = self.open and (self.dir / "manifest.json").exists()  # looked at first: the index is final then
        committed = hs.committed_shards(self.dir)
        if len(self.arrivals) < len(self.replay):
            return committed.get(self.replay[len(self.arrivals)])
        taken = set(self.arrivals)
        if self.open:  # one writer (01b): commit order
            entry = next((e for e in committed.values() if e["k"] not in taken), None)
            self.ended = entry is None and done
            return entry
        if len(list(self.dir.glob("index*.jsonl"))) > 1:  # several producer ranks: shard order
            k = min(k for k in self.shards if k not in taken)
            return committed.get(k)
        for e in committed.values():  # one index: commit order (entries come sorted by it)
            if e["k"] not in taken and e["k"] in self.shards:
                return e
        return None

    def take(self, entry: dict) -> None:
        k = entry["k"]
        if self.open:
            split_shard(self, entry)
        elif entry["ids"] != self.shards[k]["ids"]:
            raise PipelineError(f"{entry['shard']} of {self.dir} holds other samples than its {hs.PLAN} lists; "
                                "rerun 02 with --validate")
        if k in self.consumed:
            self.use_heldout(k)  # its training batches lie before the resumed step
        else:
            self.store.add(entry)
            if self.config.consume and self.d.main:
                self.copy_heldout(entry)
        with self.lock:
            self.start[k] = len(self.stream)
            self.stream.extend(self.batches[k])
            self.arrivals.append(k)
        self.last_new = time.monotonic()

    def take_ready(self, n: int) -> bool:
        """Take the committed shards (in arrival order) until the stream holds `n` batches or every
        shard is taken: whether it got there without waiting."""
        while len(self.stream) < n and not self.all_taken():
            entry = self.next_entry()
            if entry is None:
                return self.ended
            self.waiting = False
            self.take(entry)
        return True

    def ensure(self, n: int) -> None:
        """Take shards until the stream holds `n` batches (or every shard is taken), waiting for
        the producer when the next one is not committed yet (the loader thread; the trainer's
        batches_for decides, with every rank, when the wait has lasted --follow-timeout)."""
        while not self.take_ready(n):
            if self.stopping.is_set():
                raise PipelineError("stopped while waiting for shards")
            self.wait()

    def finish(self) -> None:
        """Every shard taken: the last validation sees every held-out sample. Under torchrun the
        ranks poll together, so they all go on, or all stop at --follow-timeout (Starved)."""
        while True:
            self.take_ready(self.plan.batches_total + 1)
            missing, starved = self.agree(not self.all_taken(), self.starved())
            if not missing:
                return
            if starved:
                raise Starved(self.starved_line())
            self.wait()

    def agree(self, *flags: bool) -> list[bool]:
        """Each flag true on any rank (one all-reduce under torchrun: every rank calls it as often)."""
        if self.d.world == 1:
            return list(flags)
        t = self.d.sum(torch.tensor([int(f) for f in flags], dtype=torch.int64, device=self.d.device))
        return [bool(v) for v in t.tolist()]

    def starved(self) -> bool:
        return self.waiting and time.monotonic() - self.last_new > self.config.follow_timeout

    def committed(self) -> str:
        """"N of M committed" (open-ended: M is not known yet)."""
        if self.open:
            return f"{len(hs.committed_shards(self.dir))} committed (the producer has not finished)"
        return f"{len(set(hs.committed_shards(self.dir)) & set(self.shards))} of {len(self.shards)} committed"

    def starved_line(self) -> str:
        return (f"no new shard in {self.dir} for {self.config.follow_timeout:.0f} s (--follow-timeout; "
                f"{self.committed()}, {len(self.arrivals)} trained from): is the producer "
                f"still running? see {self.dir / 'progress.log'}")

    def wait(self) -> None:
        now = time.monotonic()
        if self.d.main and (not self.waiting or now - self.said >= self.config.progress_every):
            hs.note(self.log_path, STAGE, f"waiting for shards: {self.committed()}, "
                                          f"{len(self.arrivals)} taken (producer: {self.dir / 'progress.log'})")
            self.said = now
        self.waiting = True
        time.sleep(POLL_S)

    def batches_for(self, future, step: int, save):
        """A prefetched step's batches, the trainer being at `step`. While a loader waits for a
        shard, trained unconsumed shards are checkpointed (`save`) so they are deleted (a producer
        may wait for that room); once one has waited --follow-timeout, Starved. Under torchrun the
        ranks poll in lockstep (agree), so they save and stop together."""
        while True:
            pending, starved, waiting = self.agree(not future.done(), self.starved(), self.waiting)
            if not pending:
                return future.result()
            if starved:
                raise Starved(self.starved_line())
            if self.config.consume and waiting and self.trained(step) - self.consumed:
                save()
            with contextlib.suppress(FutureTimeout):
                future.result(timeout=POLL_S)

    def stop(self) -> None:
        self.stopping.set()

    # -- validation

    def val_ready(self, step: int) -> list[str]:
        """The held-out ids validation at `step` reads: those of the shards the stream reached
        before it (a function of the arrival order, not of timing); all of them at the end of the pass."""
        last = step >= self.plan.total_steps
        if last:
            self.finish()
        with self.lock:
            reached = [k for k in self.arrivals if self.start[k] < step * self.plan.per_step or last]
        ids = {sid for k in reached for sid in self.shards[k]["ids"]}
        return [sid for sid in self.plan.val if sid in ids]

    def val_batches(self, step: int) -> tuple[list, bool]:
        """(validation batches at `step`, whether they hold every held-out sample)."""
        ids = self.val_ready(step)
        cfg = self.config
        return (pack(ids, self.plan.lengths, cfg.max_tokens_per_batch, None, max_sample=cfg.max_sample_tokens),
                len(ids) == len(self.plan.val) and (self.ended or not self.open))  # open: more may come

    # -- consumption

    def trained(self, step: int) -> set[int]:
        """Shards every batch of which lies before `step` (all taken ones once the pass is over). A shard
        without a training batch (all held out or too short) counts once the steps reached it, at step 0
        when it came first: a bounded producer may be waiting for it to go before it writes the next."""
        done = step * self.plan.per_step
        with self.lock:
            if step >= self.plan.total_steps and self.all_taken():
                return set(self.arrivals)
            return {k for k in self.arrivals if self.start[k] + len(self.batches[k]) <= done}

    def state(self, step: int) -> dict:
        """What a checkpoint at `step` records: the arrival order, and (--consume) the shards it
        consumes; `consume()` deletes them once the checkpoint is committed."""
        with self.lock:
            arrivals = list(self.arrivals)
        if self.config.consume:
            self.pending = self.trained(step) - self.consumed
        out = {"arrivals": arrivals, "consumed": sorted(self.consumed | self.pending)}
        if self.open:  # made as the shards came (a replay of the arrivals makes it again)
            with self.lock:
                out["val"] = list(self.plan.val)
        return out

    def consume(self) -> None:
        for k in sorted(self.pending):
            self.consumed.add(k)
            self.delete(k)
        self.pending = set()
        if self.d.main and self.config.consume and self.all_taken() and len(self.consumed) == len(self.arrivals):
            self.close_heldout()

    def close_heldout(self) -> None:
        """OUT/heldout as a complete store of the held-out samples (the producer's format and
        counts of what it holds), so 05 --store reads it once the store itself is consumed."""
        from eagle3_train.common.manifest import write_manifest

        entries = hs.committed_shards(self.heldout)
        header = {k: self.store.manifest.get(k) for k in hs.HEADER_KEYS}
        write_manifest(self.heldout, hs.STAGE, config={"copied_from": str(self.dir), "by": f"{STAGE} --consume"},
                       outputs={"shards": [e["shard"] for e in entries.values()]},
                       counts={"samples": sum(len(e["ids"]) for e in entries.values()),
                               "tokens": sum(e["tokens"] for e in entries.values()), "shards": len(entries)},
                       **header)

    def delete(self, k: int) -> None:
        path = self.dir / hs.shard_name(k)
        self.store.forget(str(path))
        self.use_heldout(k)
        if self.d.main:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    def use_heldout(self, k: int) -> None:
        """Read shard k's held-out samples from their copy (its source is or will be deleted)."""
        entry = hs.committed_shards(self.heldout).get(k) if self.heldout.is_dir() else None
        if entry is not None:
            self.store.add(entry, self.heldout)

    def copy_heldout(self, entry: dict) -> None:
        """Shard k's held-out samples, their rows as stored (bit for bit), into OUT/heldout."""
        from safetensors import safe_open

        k = entry["k"]
        rows = [(sid, off, n) for sid, off, n in zip(entry["ids"], entry["offsets"], entry["lengths"])
                if sid in self.val_ids]
        if not rows or k in hs.committed_shards(self.heldout):
            return
        f = safe_open(str(self.dir / entry["shard"]), framework="pt")
        meta = json.loads((f.metadata() or {}).get(hs.SHARD_META, "{}"))
        meta = {key: v for key, v in meta.items() if key not in ("ids", "offsets", "lengths")}
        tensors = {name: torch.cat([f.get_slice(name)[off: off + n] for _, off, n in rows]) for name in f.keys()}
        hs.write_shard(self.heldout, k, [{"id": sid, "length": n} for sid, _, n in rows], tensors, meta=meta)

    def restore(self, state: dict | None) -> None:
        """A resume: replay the recorded arrivals; finish deleting what the checkpoint consumed."""
        if not state:
            return
        self.replay = list(state.get("arrivals") or [])
        self.consumed = set(state.get("consumed") or [])
        if self.d.main:
            for k in self.consumed:
                with contextlib.suppress(FileNotFoundError):
                    (self.dir / hs.shard_name(k)).unlink()
            if self.config.consume and not self.open and len(self.consumed) == len(self.shards):
                self.close_heldout()  # a kill came between the last checkpoint and this (open: end_pass)

    def announce(self) -> str:
        length = ("an open-ended pass (the producer plans nothing ahead; it ends with its manifest)" if self.open
                  else f"one pass of {self.plan.total_steps} steps")
        committed = hs.committed_shards(self.dir)
        committed = (f"{len(committed)} shards committed so far" if self.open
                     else f"{len(set(committed) & set(self.shards))} of {len(self.shards)} shards committed")
        return (f"{STAGE}: following {self.dir}: {committed}, {length} in their commit order"
                + ("; each shard is deleted once trained and checkpointed" if self.config.consume else "")
                + (f"; replaying {len(self.replay)} recorded arrivals" if self.replay else ""))
