"""04's run: train (or resume) the draft, validate and checkpoint at intervals, export the best.

One optimizer step consumes `world_size x grad_accum` packed batches (data.py). The run directory:
  run.json                   the config + input identities (a rerun must match, or --overwrite)
  checkpoints/step-XXXXXXX/  see checkpoint.py (valid only with COMPLETE)
  metrics.jsonl              see metrics.Recorder
  progress.log, curves.png, export/ (what vLLM serves), manifest.json (written last)
"""

from __future__ import annotations

import contextlib
import functools
import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from eagle3_train.common.errors import PipelineError
from eagle3_train.common.manifest import MANIFEST, read_manifest, text_config
from eagle3_train.common.progress import Progress
from eagle3_train.common.store import atomic_write_json
from eagle3_train.train import flex
from eagle3_train.train.budget import choose_length, choose_lr, parse_budget
from eagle3_train.train.checkpoint import Checkpointer
from eagle3_train.train.config import (
    CKPT_DIR,
    DFLASH_WINDOW,
    EXIT_FOLLOW_TIMEOUT,
    EXPORT,
    SCHEDULE,
    STAGE,
    STOPPED,
    TrainConfig,
)
from eagle3_train.train.data import Loader, make_plan, shifted
from eagle3_train.train.dist import Dist, setup_dist
from eagle3_train.train.draft import lr_lambda, step_norms
from eagle3_train.train.follow import FollowTimeout, Starved
from eagle3_train.train.inputs import Inputs, input_identity, open_inputs
from eagle3_train.train.metrics import Meter, Recorder
from eagle3_train.train.model import build_model, draft_arch
from eagle3_train.train.objective import batch_metrics, combine, prepare, sampled_stats
from eagle3_train.train.recipe import build_optimizers, time_steps
from eagle3_train.train.resolve import resolve_draft


def run(config: TrainConfig, *, on_step: Callable[[int], None] | None = None) -> dict:
    """Train (or resume), validate, checkpoint, export; 04's manifest. Every process of a
    torchrun calls it; `on_step(step)` after each step is how tests interrupt a run."""
    from eagle3_train.common import rerun
    from eagle3_train.common.store import DirLock, clean_temp_files
    from eagle3_train.train.export import export

    d = setup_dist(config.device)
    if config.threads:
        torch.set_num_threads(config.threads)
    out = Path(config.output_dir)
    inp = open_inputs(config, d.dtype)
    resolve_draft(config, inp, out)  # a draft the target cannot have: refused before anything is written
    identity = input_identity(inp, config.vocab_mapping)
    with DirLock(out, STAGE) if d.main else contextlib.nullcontext():
        if d.main:
            out.mkdir(parents=True, exist_ok=True)
            clean_temp_files(out)
            clean_temp_files(out / CKPT_DIR)
            with contextlib.suppress(FileNotFoundError):  # says how the last run stopped, not this one
                (out / STOPPED).unlink()
            # Resume this run, refuse another one, or (--overwrite) move it aside and start over.
            rerun.prepare(config, inputs=identity)
        d.barrier()
        try:
            if (out / MANIFEST).exists():  # finished: rerunning its command does nothing
                return finished(out, d)
            trainer = Trainer(config, d, inp, out)
            trainer.train(on_step)
            return export(trainer, identity)
        finally:
            d.close()


def finished(out: Path, d: Dist) -> dict:
    man = read_manifest(out, STAGE)
    if d.main and (out / EXPORT / "config.json").exists():
        print(f"{out} is complete (step {man['counts'].get('steps')}); export: {out / EXPORT}")
    return man


class Trainer:
    """Everything a run holds: the data plan, model, optimizer, checkpointer and recorder."""

    def __init__(self, config: TrainConfig, d: Dist, inp: Inputs, out: Path):
        self.config, self.d, self.inp, self.out = config, d, inp, out
        resolve_draft(config, inp, out)  # run() did; a Trainer made on its own (the memory check) too
        per_step = d.world * config.grad_accum
        self.follow = None  # --follow: the growing store's shards, in arrival order (follow.py)
        if config.follow:
            from eagle3_train.train.follow import Follow, FollowLoader

            self.follow = Follow(config, inp.store, out, per_step, d)
            first, loader = self.follow.plan, FollowLoader
        else:
            first, loader = make_plan(inp.store, config, per_step, epochs=1), Loader  # one epoch decides the steps
        self.model = build_model(config, inp, d)
        self.lr = self.choose_lr()
        self.optimizers = build_optimizers(config, self.model.objective, d.cuda, self.lr["lr"])
        self.loader = loader(inp.store, first, config, inp.aux_index, d.rank, d.world, self.model.kernels["attn"])
        self.loader.follow = self.follow
        self.group_tokens = config.resolve_group_tokens(self.model.kernels["attn"], d.world)
        self.length = self.choose_length(first)
        self.plan = first if self.length["epochs"] == 1 else make_plan(inp.store, config, per_step,
                                                                       epochs=self.length["epochs"])
        self.loader.plan = self.plan
        self.total_steps = min(self.length["total_steps"] or self.plan.total_steps, self.plan.total_steps)
        self.open = None  # open-ended --follow: the lr rule whose horizon the first --save-every checkpoint fixes
        if self.follow is not None and self.follow.open:
            from eagle3_train.train.follow_open import OpenSchedule, default_warmup

            rule = self.open = OpenSchedule(functools.partial(lr_lambda, schedule=config.schedule,
                                                              min_ratio=config.min_lr_ratio),
                                            default_warmup(config, inp.store.expected_samples, per_step))
        else:
            warmup = (config.warmup_steps if config.warmup_steps is not None
                      else int(config.warmup_ratio * self.total_steps))
            rule = functools.partial(lr_lambda, warmup=warmup, total=self.total_steps, schedule=config.schedule,
                                     min_ratio=config.min_lr_ratio)
        # One schedule per optimizer: each group's lr follows the same curve from its own base.
        self.schedulers = [torch.optim.lr_scheduler.LambdaLR(o, rule) for o in self.optimizers]
        self.checkpointer = Checkpointer(out, d, interval=config.save_every, keep_last=config.keep_last)
        self.best = {"step": None, "acceptance_length": None}  # by validation acceptance
        self.step = 0
        self.saved_step = self.validated_step = None  # of the last checkpoint; the last validation's

    def choose_lr(self) -> dict:
        """{"lr", "lr_why"}: --lr or the width rule (budget.choose_lr); a resume keeps the one its
        first run chose (schedule.json; a run recorded before the rule used --lr, its default 3e-3)."""
        path = self.out / SCHEDULE
        if path.exists():
            kept = json.loads(path.read_text())
            return {"lr": kept["lr"], "lr_why": kept.get("lr_why", "--lr")}
        width = self.config.draft_width(text_config(self.inp.target_cfg).hidden_size)
        return choose_lr(self.config.lr, width)

    def choose_length(self, first) -> dict:
        """Epochs and steps (budget.choose_length), kept in schedule.json so a resume keeps them
        (a time budget's pace is measured once, on the first run)."""
        path, config = self.out / SCHEDULE, self.config
        existed = path.exists()
        # every rank looks before rank 0 may write: a slower rank that found the new file would skip
        # the barrier below, and rank 0 would wait there for ever
        self.d.barrier()
        if existed:
            return json.loads(path.read_text())
        budget = parse_budget(config.budget)
        pace = None
        if budget is not None and budget.kind == "time":
            pace = self.calibrate(first)
        tokens = sum(shifted(first.lengths[i], config.max_sample_tokens) for i in first.train)
        length = choose_length(epochs=config.epochs, budget=budget, max_steps=config.max_steps,
                               steps_per_epoch=first.steps_in(0), tokens_per_epoch=tokens, seconds_per_step=pace)
        length |= {"steps_per_epoch": first.steps_in(0), "train_tokens_per_epoch": tokens,
                   "optimizer": config.optimizer, **self.lr, "schedule": config.schedule,
                   "ttt_steps": config.ttt_steps, "norm_before_fc": config.norm_before_fc, "loss": config.loss,
                   "window_tokens": config.window_tokens, "window_context": config.context_tokens}
        if self.follow is not None and self.follow.open:  # the steps are known only at the producer's end
            length |= {"total_steps": config.max_steps, "steps_per_epoch": None, "horizon": None,
                       "why": "open-ended --follow: one pass, as long as the producer's shards make it"
                              + (f"; --max-steps {config.max_steps}" if config.max_steps else "")}
        if pace is not None:
            length["seconds_per_step"] = pace
        if self.d.main:
            atomic_write_json(path, length)
        self.d.barrier()
        return json.loads(path.read_text()) if path.exists() else length

    def calibrate(self, first, n: int = 3) -> float:
        """Seconds per training step, over `n` forward + backward passes after a warm-up one (no
        optimizer step: nothing is trained); the slowest rank's."""
        def one(i):
            self.forward_backward(self.loader.step(i % first.steps_in(0)))
            for o in self.optimizers:
                o.zero_grad(set_to_none=True)

        pace = torch.tensor(time_steps(one, n), dtype=torch.float64, device=self.d.device)
        if self.d.world > 1:
            torch.distributed.all_reduce(pace, op=torch.distributed.ReduceOp.MAX)
        return float(pace)

    def train(self, on_step: Callable[[int], None] | None = None) -> None:
        config, d, total_steps = self.config, self.d, self.total_steps
        # Resume from the last complete checkpoint: weights, optimizer, scheduler, RNG, the
        # metric sums of the interval it was in, and the data position (= the step).
        meter = Meter(config.draft_steps, self.resume())
        shown = total_steps
        if self.open is not None:  # shown against the most steps the expected samples can make, then H
            expected = self.inp.store.expected_samples
            shown = self.open.horizon or max(1, int(expected * (1 - config.val_fraction) / self.plan.per_step))
        progress = Progress(STAGE, shown, initial=self.step, unit="step", every_s=config.progress_every,
                            log_path=self.out / "progress.log" if d.main else None, disable=not d.main or config.quiet)
        self.recorder = recorder = Recorder(self.out, d.main, progress)
        if self.checkpointer.resumed_from:
            recorder.write({"kind": "resume", "step": self.step, "from": self.checkpointer.resumed_from.name,
                            "time": time.time()})
            self.checkpointer.relog(self.step, recorder)
        self.announce()
        # The next step's batches load in a thread while this one trains.
        prefetch = ThreadPoolExecutor(1)
        upcoming = prefetch.submit(self.loader.step, self.step) if self.step < total_steps else None
        self.model.objective.train()
        started = self.step
        try:
            try:
                while self.step < total_steps:
                    if self.follow is None:
                        micro_batches = upcoming.result()
                    else:  # waiting for a shard, it may checkpoint to delete the trained ones
                        micro_batches = self.follow.batches_for(upcoming, self.step,
                                                                lambda: self.validate_and_save(meter, validate=False))
                    if micro_batches is None:  # open-ended: the producer is done, fewer than a step is left
                        total_steps = self.end_pass(meter)
                        break
                    if self.step + 1 < total_steps:
                        upcoming = prefetch.submit(self.loader.step, self.step + 1)
                    loss, metrics, grad_norm, lr = self.train_step(micro_batches)
                    self.step += 1
                    meter.add(loss, metrics, grad_norm)
                    recorder.step(loss, lr, metrics["tokens"])
                    if self.step % config.log_every == 0 or self.step == total_steps:
                        # Summed over processes: every rank takes part, rank 0 writes.
                        recorder.train(self.step, self.plan.locate(self.step - 1)[0], lr, meter.reduce(d))
                        meter = Meter(config.draft_steps)
                    if self.checkpointer.should_save(self.step, last_step=total_steps):
                        if self.open is not None and self.open.horizon is None and self.step % config.save_every == 0:
                            self.fix_horizon(progress)
                        self.validate_and_save(meter)
                    if on_step is not None:
                        on_step(self.step)
                if self.open is not None and not self.plan.cut:  # stopped by --max-steps before the pass's end
                    self.follow.summarize()
                if self.validated_step != self.step:
                    # resumed at the last step from a checkpoint that did not validate (--follow saves
                    # one before the last validation waits for every shard): validate before export
                    self.validate_and_save(meter)
            except Starved as e:
                self.stop_starved(meter, str(e), started)
        finally:
            if self.follow is not None:
                self.follow.stop()  # a loader waiting for a shard gives up
            prefetch.shutdown(wait=True, cancel_futures=True)
            recorder.close("finished" if self.step >= total_steps else f"stopped at step {self.step}")

    def fix_horizon(self, progress: Progress) -> None:
        """Open-ended --follow, at the first --save-every checkpoint: H from what the steps so far
        trained (follow_open.horizon), kept by the scheduler's state (so by the checkpoint) and in
        schedule.json."""
        from eagle3_train.train.follow_open import horizon

        h = horizon(self.follow, self.step, self.inp.store.expected_samples)
        if self.config.max_steps:
            h["horizon"] = min(h["horizon"], self.config.max_steps)
        self.open.fix(h["horizon"], self.step)
        self.length = {**self.length, "horizon": h}
        progress.total = progress.bar.total = h["horizon"]
        if self.d.main:
            atomic_write_json(self.out / SCHEDULE, self.length)
            print(f"{STAGE}: horizon {h['horizon']} steps (at step {self.step}: {h['trained_samples']} training "
                  f"samples trained of ~{h['expected_samples'] * h['train_share']:.0f} expected); "
                  f"{self.config.schedule} lr over it from here", flush=True)

    def end_pass(self, meter: Meter) -> int:
        """Open-ended --follow: the pass is over at this step; its last train record, its length."""
        self.total_steps = self.follow.end_pass(self.step)
        if meter.s["n"]:  # the steps since the last record (a resume at the end has none)
            sched = self.schedulers[0]
            lr = sched.base_lrs[0] * sched.lr_lambdas[0](self.step - 1)  # the last step's, resumed or not
            self.recorder.train(self.step, self.plan.locate(self.step - 1)[0], lr, meter.reduce(self.d))
            meter.s = Meter(self.config.draft_steps).s
        self.length = {**self.length, "total_steps": self.total_steps}
        return self.total_steps

    def unsaved(self) -> bool:
        """Whether the last checkpoint misses this step, or (--consume) trained shards to delete."""
        follow = self.follow
        return self.saved_step != self.step or bool(follow and self.config.consume
                                                    and follow.trained(self.step) - follow.consumed)

    def stop_starved(self, meter: Meter, why: str, started: int) -> None:
        """--follow-timeout: checkpoint what this run trained (every rank together), so a rerun
        neither retrains it nor keeps the shards it trained; FollowTimeout (exit 75) if it trained a
        step, else an error: the producer never came, or the bound holds fewer shards than one step
        needs (shards taken without a step are in no checkpoint, so a driver that reran on 75 would
        take them again, and loop for ever)."""
        if self.step == started:
            raise PipelineError(f"{why}; this run trained no step (is --max-store-gb below the shards one "
                                "step needs, or the producer stopped?)")
        if self.unsaved():
            self.validate_and_save(meter, validate=False)
        line = f"{why}; checkpointed at step {self.step} of {self.total_steps}: rerun to go on"
        if self.d.main:
            atomic_write_json(self.out / STOPPED, {"stopped": "follow-timeout", "exit_code": EXIT_FOLLOW_TIMEOUT,
                                                   "step": self.step, "message": line, "time": time.time()})
        # torchrun kills the ranks still running once one exits non-zero: no rank leaves before rank 0
        # has written the record the driver loop reads (torchrun itself reports 75 as 1).
        self.d.barrier()
        raise FollowTimeout(line)

    def resume(self) -> dict | None:
        """Load the last checkpoint, if any (its meter sums returned); else seed a fresh run."""
        state = self.checkpointer.load(self.model.objective, self.optimizers, self.config.optimizer)
        if state is None:
            torch.manual_seed(self.config.seed)
            return None
        for sched, sd in zip(self.schedulers, state.get("schedulers") or [state["scheduler"]], strict=True):
            sched.load_state_dict(sd)
        self.step, self.best = state["step"], state["best"]
        self.saved_step = self.step
        self.validated_step = self.step if state.get("validated", True) else None
        if self.follow is not None:
            self.follow.restore(state.get("follow"))
        if state.get("per_step") != self.plan.per_step and self.d.main:
            print(f"note: {self.checkpointer.resumed_from.name} was made with {state.get('per_step')} batches "
                  f"per step, this run uses {self.plan.per_step}; the data order from here differs from the "
                  "original run")
        return state.get("meter")

    def train_step(self, micro_batches: list) -> tuple[float, dict, float, float]:
        """One optimizer step over this process's micro-batches (gradients averaged over them,
        and over processes by DDP/FSDP): (mean loss, metrics, gradient norm, the lr it used)."""
        for o in self.optimizers:
            o.zero_grad(set_to_none=True)
        loss, metrics = self.forward_backward(micro_batches)
        grad_norm = clip_grad_norm(self.model.parameters, self.config.grad_clip)
        lr = self.schedulers[0].get_last_lr()[0]
        for o, sched in zip(self.optimizers, self.schedulers, strict=True):
            o.step()
            sched.step()
        return loss, metrics, grad_norm, lr

    @flex.in_one_line  # a flex kernel that does not fit at a step: one error line (flex.step_error)
    def forward_backward(self, micro_batches: list) -> tuple[float, dict]:
        """Gradients of one step's micro-batches (averaged): (mean loss, metrics)."""
        model, d = self.model, self.d
        loss, parts = 0.0, []
        for i, batch in enumerate(micro_batches):
            # Targets from the frozen head outside the wrapped model: DDP never broadcasts it.
            batch = prepare(batch.to(d.device, d.dtype), model.head, self.config.draft_steps, self.group_tokens)
            with model.sync(last=i + 1 == len(micro_batches)):
                with d.autocast():
                    draft_tokens, batch_loss, metrics = model.wrapped(batch)
                (batch_loss / len(micro_batches)).backward()
            loss += float(batch_loss.detach()) / len(micro_batches)
            parts.append(batch_metrics(batch, draft_tokens, metrics, model.to_target))
        return loss, combine(parts)

    def validate(self) -> dict | None:
        """Over this rank's share of the fixed validation batches, summed over ranks. Every rank
        runs the same number of forwards (FSDP gathers weights in each), the extra ones on a
        repeated batch that is not counted. Batches load one at a time (a long held-out set of
        a large target does not fit on the device at once)."""
        if not self.plan.val:
            return None
        model, d, batches = self.model, self.d, self.loader.val_batches
        edges = self.config.position_edges
        meter = Meter(self.config.val_steps, edges=edges)
        mine = batches[d.rank::d.world]
        model.objective.eval()
        with torch.no_grad():
            for i in range(-(-len(batches) // d.world)):
                batch = self.loader.collate(mine[i] if i < len(mine) else batches[0]).to(d.device, d.dtype)
                batch = prepare(batch, model.head, self.config.val_steps, self.group_tokens)
                with d.autocast():
                    draft_tokens, loss, metrics = model.wrapped(batch)
                if i < len(mine):
                    part = batch_metrics(batch, draft_tokens, metrics, model.to_target, edges)
                    if self.config.val_temperature > 0:  # as vLLM verifies sampled requests; seeded by the batch
                        part["chain"] = sampled_stats(batch, draft_tokens, model.to_target, model.head,
                                                      self.config.val_temperature,
                                                      self.config.seed * 1_000_003 + d.rank + i * d.world, edges)
                    meter.add(float(loss), part)
        model.objective.train()
        return meter.reduce(d)

    def validate_and_save(self, meter: Meter, validate: bool = True) -> None:
        """Validate, keep the best, checkpoint (the best is never pruned). --follow: on the held-out
        samples reached so far, the best only among checkpoints that saw all; --consume deletes the
        shards this checkpoint records as trained once it is committed."""
        complete = True
        if self.follow is not None and validate and self.step >= self.total_steps and self.unsaved() \
                and (self.config.consume or len(self.follow.arrivals) < len(self.follow.shards)):
            # The last validation waits for every shard (their held-out samples), and a producer bound
            # by --max-store-gb waits for room: checkpoint first, so the trained shards are deleted
            # (and a --follow-timeout there loses no step).
            self.validate_and_save(meter, validate=False)
        if self.follow is not None and validate:
            self.loader.val_batches, complete = self.follow.val_batches(self.step)
        val = self.validate() if validate else None
        if val is not None and complete and better(val, self.best):
            self.best = {"step": self.step, "acceptance_length": val["acceptance_length"], "loss": val["loss"]}
        epoch, in_epoch = self.plan.locate(self.step)
        position = {"epoch": epoch, "batches_in_epoch": in_epoch * self.plan.per_step}
        state = {"step": self.step, "best": self.best, "schedulers": [s.state_dict() for s in self.schedulers],
                 "optimizer": self.config.optimizer, "meter": meter.s, "validated": validate,
                 "per_step": self.plan.per_step, **position}
        summary = {"step": self.step, **position, "total_steps": self.total_steps, "val": val, "best": self.best,
                   "world_size": self.d.world, "time": time.time()}
        if self.follow is not None:  # the arrival order a resume replays, the shards consumed
            state["follow"] = summary["follow"] = self.follow.state(self.step)
        if self.open is not None:
            summary["horizon"] = self.open.horizon
        path = self.checkpointer.save(self.step, self.model.objective, self.optimizers, state, summary,
                                      {self.best["step"]} if self.best["step"] else set())
        self.recorder.checkpoint(self.step, path, val)
        self.saved_step = self.step
        if validate:
            self.validated_step = self.step
        if self.follow is not None:
            self.follow.consume()

    def announce(self) -> None:
        if not self.d.main:
            return
        plan, model = self.plan, self.model
        cut = plan.cut
        c = self.config
        if self.open is not None:  # nothing is known of the data before its shards come
            print(self.follow.announce(), flush=True)
            print(f"{STAGE}: recipe: {self.length['why']}; {c.optimizer} lr {self.lr['lr']:g} ({self.lr['lr_why']}), "
                  f"warm-up {self.open.warmup} steps, then {c.schedule} over a horizon "
                  + (f"of {self.open.horizon} steps" if self.open.horizon else
                     f"fixed at step {c.save_every} (--save-every) from ~{self.inp.store.expected_samples} expected "
                     "samples")
                  + (f"; resuming at step {self.step}" if self.step else ""), flush=True)
            return
        for part in ("train", "val"):
            if cut[part]["samples"]:  # loud: these tails are never trained (or validated) on
                print(f"warning: {cut[part]['samples']} of {len(getattr(plan, part))} {part} samples are longer "
                      f"than --max-sample-tokens {cut[part]['max_sample_tokens']} and cut: {cut[part]['tokens']:,} "
                      f"tokens ({cut[part]['token_share']:.1%} of the {part} tokens) are not {part}ed on",
                      flush=True)
        # the window never cuts a trained context; DFlash's default one is for long answers, silent on short data
        chosen = c.draft_window and (c.draft_arch != "dflash" or c.draft_window != DFLASH_WINDOW)
        if chosen and c.draft_window >= cut["longest"]:
            print(f"warning: --draft-window {c.draft_window} is not shorter than the longest sample "
                  f"({cut['longest']:,} tokens): the draft trains as with full attention and meets its window only "
                  f"in vLLM, on longer answers", flush=True)
        print(f"{STAGE}: {len(plan.train)} train / {len(plan.val)} val samples ({plan.dropped} too short, "
              f"{cut['own_batch']} longer than --max-tokens-per-batch {self.config.max_tokens_per_batch} in a "
              f"batch of their own, longest {cut['longest']:,} tokens), {plan.steps_in(0)} steps/epoch x "
              f"{self.length['epochs']} epochs -> {self.total_steps} steps; "
              f"{sum(p.numel() for p in model.parameters):,} trainable parameters; device {self.d.device} "
              f"x{self.d.world}; attention {model.kernels['attn']}"
              + (f" over groups of samples of at most {self.group_tokens} tokens" if self.group_tokens else "")
              + f", loss {model.kernels['loss_impl']}; "
              f"{'top-k' if self.inp.topk else 'hidden-state'} targets"
              + (f"; resuming at step {self.step}" if self.step else ""))
        if self.follow is not None:
            print(self.follow.announce(), flush=True)
        print(f"{STAGE}: recipe: {self.total_steps} steps over {self.length['epochs']} epochs "
              f"({self.length['why']}); {c.optimizer} lr {self.lr['lr']:g} ({self.lr['lr_why']}) {c.schedule}, "
              + (f"DFlash block {c.blocks}, " if c.draft_arch == "dflash" else f"TTT {c.ttt_steps}, ")
              + f"loss {c.loss}, norm_before_fc {'on' if c.norm_before_fc else 'off'}"
              + (f", attention window {c.draft_window}" if c.draft_window else "")
              + ("" if c.draft_arch == "dflash" else
                 ", norm_before_residual {}, norm_output {}".format(
                     *("on" if on else "off" for on in step_norms(draft_arch(c, self.inp), c.norm_before_residual,
                                                                   c.norm_output))))
              + (f"; training samples as {cut['windows']:,} windows of {c.window_tokens} positions after up to "
                 f"{c.context_tokens} of context (validation: whole samples)" if c.window_tokens else ""), flush=True)


def better(val: dict, best: dict) -> bool:
    """Higher acceptance length (as vLLM counts it: the walk) wins; on a tie, the lower loss."""
    if best.get("acceptance_length") is None:
        return True
    if val["acceptance_length"] != best["acceptance_length"]:
        return val["acceptance_length"] > best["acceptance_length"]
    return val["loss"] < best.get("loss", float("inf"))


def clip_grad_norm(params, clip: float) -> float:
    norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))
    if hasattr(norm, "full_tensor"):  # a DTensor under FSDP
        norm = norm.full_tensor()
    return float(norm)
