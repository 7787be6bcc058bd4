"""02's engine: run the target over the tokenized training set and store EAGLE-3's features.

Layer convention (DESIGN.md): id i = the residual stream entering decoder layer i (HF
`hidden_states[i]`, vLLM's aux id i); id N = the last layer's output *before* the final norm.
The `hf` backend (extract_hf.py) captures exactly those tensors with forward pre-hooks; the
`vllm` backend (vllm_extract.py) gets the same tensors from vLLM's `extract_hidden_states` method.

Flow: the input is scanned (ids, lengths, byte offsets, sha256); the run is checked against
run.json (rerun.py: same input, target, layers and storage, or --overwrite); plan.json fixes which samples
go to which shard (first run only); each shard not yet committed (and, with several ranks, owned
by this rank: k % world_size == rank) is computed batch by batch, encoded (bf16 / fp8 / top-k),
written atomically and indexed; the manifest is written once every shard of the plan is in.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from eagle3_train.common import hidden_store as hs
from eagle3_train.common import rerun
from eagle3_train.common.errors import PipelineError
from eagle3_train.common.formats import dflash_target_layers
from eagle3_train.common.hidden_checks import validate_shard
from eagle3_train.common.manifest import MANIFEST, describe_tokenizer, write_manifest
from eagle3_train.common.progress import Progress
from eagle3_train.common.store import ByteDigest, DirLock, atomic_write_json, clean_temp_files
from eagle3_train.common.target import target_info
from eagle3_train.common.target_layout import check_hf_loadable, check_vocab
from eagle3_train.tokenize.dataset import TrainingSet

DISK_MARGIN = 1.02  # headers, index, plan: a few per cent on top of the tensor bytes


# ----------------------------------------------------------------------------- input

@dataclass
class InputSet:
    """The tokenized set (dataset.TrainingSet), scanned once: ids in file order, lengths and byte
    offsets, sha256 of exactly the bytes read; 02 also needs every sample non-empty and unique."""
    data: TrainingSet
    ids: list[str] = field(default_factory=list)
    lengths: dict[str, int] = field(default_factory=dict)
    offsets: dict[str, int] = field(default_factory=dict)
    sha256: str = ""
    size: int = 0
    max_token_id: int = -1

    @classmethod
    def open(cls, directory: Path) -> InputSet:
        self = cls(TrainingSet(directory))
        read = ByteDigest()
        for line in self.data.lines(digest=read):
            rec, sid = line.record, str(line.record["id"])
            where = f"{self.path}:{line.lineno}"
            if not rec["input_ids"]:
                raise PipelineError(f"{where}: sample {sid} has no tokens")
            if sid in self.lengths:
                raise PipelineError(f"{where}: duplicate sample id {sid!r}")
            self.ids.append(sid)
            self.lengths[sid] = len(rec["input_ids"])
            self.offsets[sid] = line.offset
            self.max_token_id = max(self.max_token_id, max(rec["input_ids"]))
        self.sha256, self.size = read.hexdigest(), read.size
        if not self.ids:
            raise PipelineError(f"{self.path} has no samples")
        return self

    @property
    def directory(self) -> Path:
        return self.data.directory

    @property
    def path(self) -> Path:
        return self.data.path

    @property
    def manifest(self) -> dict:
        return self.data.manifest

    @property
    def tokenizer(self) -> dict:
        return self.data.tokenizer

    @property
    def tokens(self) -> int:
        return sum(self.lengths.values())

    def records(self, ids: Sequence[str]) -> list[dict]:
        return self.data.records_at(self.offsets[sid] for sid in ids)

    def expected(self, sid: str) -> tuple[list | None, list | None]:
        if sid not in self.offsets:
            return None, None
        rec = self.records([sid])[0]
        return rec["input_ids"], rec["loss_mask"]

    def describe(self) -> dict:
        return {"path": str(self.path.resolve()), "size": self.size, "sha256": self.sha256,
                "samples": len(self.ids), "tokens": self.tokens}


# ----------------------------------------------------------------------------- layers

def vllm_default_aux_layers(num_layers: int) -> list[int]:
    """What vLLM gathers when the draft's config names no layers: (2, N // 2, N - 3)."""
    return [2, num_layers // 2, num_layers - 3]


def default_aux_layers(num_layers: int) -> list[int]:
    """vLLM's default when its ids are distinct and inside 1..N; for small targets (N = 6 gives
    2, 3, 3) each repeated or out-of-range id becomes the nearest unused id in 1..N-1 (the later
    one on a tie; N itself only when nothing else is left). Ascending, as vLLM gathers them."""
    ids: list[int] = []
    top = max(num_layers - 1, 1)
    for want in vllm_default_aux_layers(num_layers):
        want = min(max(want, 1), top)
        free = [i for i in range(1, top + 1) if i not in ids] or [i for i in (num_layers,) if i not in ids]
        if free:
            ids.append(min(free, key=lambda i: (abs(i - want), -i)))
    return sorted(ids)


DFLASH_PRESET = "dflash:"  # --layers dflash:N


def parse_layers(spec: str | None, num_layers: int, *, flag: str = "--layers") -> list[int]:
    """Aux layer ids as vLLM gathers them: ascending, each once, from the residual stream entering
    layer i (1..N; id 0 would be the embeddings, which the draft already has). An explicit list
    out of order is sorted (and says so); repeats, 0 and ids outside 1..N are refused. `dflash:N`:
    the layers 04 --target-layers per-draft-layer reads for a draft of N layers (formats.py's rule)."""
    if not spec:
        ids = default_aux_layers(num_layers)
        vllm = vllm_default_aux_layers(num_layers)
        if ids != vllm:
            print(f"aux layers: vLLM's default (2, N//2, N-3) for N={num_layers} is {_join(vllm)}, not "
                  f"{len(vllm)} distinct layers; using {_join(ids)} (the export names them, so vLLM reads the same)")
        return ids
    text = str(spec).replace(" ", "")
    if text.lower().startswith(DFLASH_PRESET):  # what a DFlash draft of N layers reads, one per layer (04's rule)
        try:
            n = int(text[len(DFLASH_PRESET):])
        except ValueError:
            raise PipelineError(f"{flag} {spec!r}: {DFLASH_PRESET}N takes the DFlash draft's layer count, "
                                f"e.g. {DFLASH_PRESET}5") from None
        return dflash_target_layers(num_layers, n, flag=f"{flag} {spec}")
    try:
        ids = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise PipelineError(f"{flag} {spec!r}: expected comma-separated layer ids, e.g. 2,30,58") from None
    return check_layers(ids, num_layers, flag=flag, spec=spec)


def check_layers(ids: Sequence[int], num_layers: int | None, *, flag: str, spec=None) -> list[int]:
    """Refuse an empty list, id 0, ids past N and repeats (one line each); sort the rest."""
    spec = spec if spec is not None else _join(ids)
    if not ids:
        raise PipelineError(f"{flag} {spec!r}: name at least one layer id")
    if 0 in ids:
        raise PipelineError(f"{flag} {spec!r}: id 0 is the embedding output, which the draft already reads; "
                            f"aux layers are 1..{num_layers or 'N'}")
    bad = [i for i in ids if i < 0 or (num_layers is not None and i > num_layers)]
    if bad:
        raise PipelineError(f"{flag} {spec!r}: ids must lie in 1..{num_layers} (the target has "
                            f"{num_layers} layers; id {num_layers} is the last layer's output)")
    twice = sorted({i for i in ids if list(ids).count(i) > 1})
    if twice:
        raise PipelineError(f"{flag} {spec!r}: layer {_join(twice)} listed more than once; vLLM gathers "
                            "each layer once, so the draft would read fewer states than it was trained on")
    if list(ids) != sorted(ids):
        print(f"{flag} {spec}: sorted to {_join(sorted(ids))} (vLLM gathers the aux states in ascending "
              "layer order; the draft's fc is trained in that order)")
    return sorted(ids)


def _join(ids) -> str:
    return ",".join(str(i) for i in ids)


# ----------------------------------------------------------------------------- driver

def rank_and_world(cfg) -> tuple[int, int]:
    rank = cfg.rank if cfg.rank is not None else int(os.environ.get("RANK", 0))
    world = cfg.world_size if cfg.world_size is not None else int(os.environ.get("WORLD_SIZE", 1))
    if world < 1 or not 0 <= rank < world:
        raise PipelineError(f"--rank {rank} must lie in 0..{world - 1} (--world-size {world})")
    return rank, world


def check_tokenizer(cfg, inp: InputSet) -> dict:
    from eagle3_train.common.tokenization import load_tokenizer

    name = cfg.tokenizer or cfg.model
    ours = describe_tokenizer(load_tokenizer(name), name)
    theirs = inp.tokenizer.get("fingerprint")
    if theirs is None:
        raise PipelineError(f"{inp.directory}/manifest.json records no tokenizer fingerprint; retokenize it")
    if ours["fingerprint"] != theirs:
        raise PipelineError(
            f"tokenizer mismatch: {inp.directory} was tokenized with {inp.tokenizer.get('name_or_path')!r} "
            f"(fingerprint {theirs}), but the target's tokenizer {name!r} has fingerprint "
            f"{ours['fingerprint']}")
    return ours


def disk_check(out: Path, need: int, *, force: bool, what: str) -> None:
    free = shutil.disk_usage(out).free
    if need * DISK_MARGIN > free and not force:
        raise PipelineError(f"not enough disk: {what} needs about {hs.human_bytes(need * DISK_MARGIN)} "
                            f"but {out} has {hs.human_bytes(free)} free; free space, choose a compact "
                            "--storage, or pass --force")


def validate(out: Path, plan: dict, inp: InputSet | None, *, storage: str, n_aux: int, hidden: int,
             topk: int, shards: Sequence[int] | None = None, progress: bool = True) -> dict[int, list[str]]:
    """{shard k: problems} over committed shards (and planned shards that are missing)."""
    committed = hs.committed_shards(out)
    todo = [s["k"] for s in plan["shards"]] if shards is None else list(shards)
    bad: dict[int, list[str]] = {}
    bar = Progress("02 validate", len(todo), unit="shard", log_path=out / "progress.log",
                   disable=None if progress else True)
    with bar:
        for k in todo:
            if k not in committed:
                bad[k] = ["not committed"]
            else:
                problems = validate_shard(out, committed[k], storage=storage, n_aux=n_aux, hidden=hidden,
                                             topk=topk, expected=inp.expected if inp else None)
                planned = plan["shards"][k]["ids"]
                if committed[k]["ids"] != planned:
                    problems.append("its samples differ from plan.json")
                if problems:
                    bad[k] = problems
            bar.update(1, errors=int(k in bad))
    return bad


def run(cfg, *, backend_factory=None) -> int:
    """The whole stage for one process (rank), for an ExtractConfig. Returns the exit code."""
    rank, world = rank_and_world(cfg)
    out = cfg.output_dir
    checking = cfg.validate_only or cfg.repair
    if cfg.overwrite and world > 1:
        raise PipelineError("--overwrite moves the output aside, which several ranks cannot do together; "
                            "run once with a single process and --overwrite, or move it yourself")
    if checking and not (out / hs.PLAN).exists():
        raise PipelineError(f"{out} holds no extraction (no {hs.PLAN}): nothing to validate")
    out.mkdir(parents=True, exist_ok=True)
    lock = DirLock(out, hs.STAGE) if world == 1 else DirLock(out / ".locks" / f"rank-{rank}", hs.STAGE)
    with lock:
        return _run_locked(cfg, out, rank, world, backend_factory, overwrite=cfg.overwrite and not checking)


def _run_locked(cfg, out: Path, rank: int, world: int, backend_factory, *, overwrite: bool) -> int:
    inp = InputSet.open(cfg.input)
    target, tcfg = target_info(cfg.model)
    if cfg.backend == "hf" and not cfg.validate_only:
        check_hf_loadable(cfg.model)
    tokenizer = check_tokenizer(cfg, inp)
    check_vocab(tcfg.vocab_size, tokenizer["vocab_size"], cfg.model)
    N, H, V = int(tcfg.num_hidden_layers), int(tcfg.hidden_size), int(tcfg.vocab_size)
    if inp.max_token_id >= V:
        raise PipelineError(f"{inp.path} has token id {inp.max_token_id}, outside the target's vocabulary of {V}")
    aux_ids = parse_layers(cfg.layers, N)
    topk = cfg.topk if cfg.storage == "fp8-topk" else 0
    if topk > V:
        raise PipelineError(f"--topk {topk} exceeds the target's vocabulary of {V}")
    bpt = hs.bytes_per_token(cfg.storage, len(aux_ids), H, topk)
    storage = hs.describe_storage(cfg.storage, len(aux_ids), H, topk)
    # What the shards are made of, as resolved against the input and the target.
    made_of = {"input_sha256": inp.sha256, "target": target, "aux_layer_ids": aux_ids, "topk": topk,
               "shard_tokens": hs.shard_tokens_for(cfg.shard_mb, bpt)}
    rerun.prepare(cfg, made_of, overwrite=overwrite, log=lambda m: print(m, file=sys.stderr))
    # Each shard's sample lengths ride along: 04 --follow packs its batches from plan.json before the
    # shards exist.
    plan = hs.load_or_create_plan(out, lambda: [
        s | {"lengths": [inp.lengths[i] for i in s["ids"]]}
        for s in hs.make_plan([(sid, inp.lengths[sid]) for sid in inp.ids], made_of["shard_tokens"])])
    vcheck = {"storage": cfg.storage, "n_aux": len(aux_ids), "hidden": H, "topk": topk}

    if cfg.validate_only:
        bad = validate(out, plan, inp, **vcheck)
        if bad:
            first = next(iter(bad.items()))
            raise PipelineError(f"{len(bad)} of {len(plan['shards'])} shards in {out} failed validation "
                                f"(first: {hs.shard_name(first[0])}: {first[1][0]}); rerun with --repair "
                                "to redo them")
        print(f"validated {len(plan['shards'])} shards, {plan['samples']} samples, {plan['tokens']} tokens: OK")
        return 0

    mine = [s for s in plan["shards"] if s["k"] % world == rank]
    if cfg.repair:
        committed = hs.committed_shards(out)
        bad = validate(out, plan, inp, shards=[s["k"] for s in mine if s["k"] in committed], **vcheck)
        if bad:
            with contextlib.suppress(FileNotFoundError):
                (out / MANIFEST).unlink()
            hs.drop_shards(out, sorted(bad), index=hs.index_name(rank, world))
            print(f"repair: {len(bad)} bad shard(s) moved aside and will be redone: "
                  + ", ".join(hs.shard_name(k) for k in sorted(bad)), file=sys.stderr)

    committed = hs.committed_shards(out)
    pending = [s for s in mine if s["k"] not in committed]
    if not pending and (out / MANIFEST).exists():
        print(f"{out} is already complete ({plan['samples']} samples); nothing to do")
        return 0
    need = sum(s["tokens"] for s in pending) * bpt
    bound = int(cfg.max_store_gb * 1e9) if cfg.max_store_gb else None
    if bound is not None:  # the store never holds more than the bound and the shard being made
        need = min(need, bound + max((s["tokens"] for s in pending), default=0) * bpt)
    disk_check(out, need, force=cfg.force,
               what=f"{sum(s['tokens'] for s in pending)} tokens x {bpt} bytes/token ({cfg.storage})")

    # What the manifest will say of the format, before the first shard: 04 --follow checks it.
    header = {"target": target, "tokenizer": tokenizer, "layer_ids": [*aux_ids, N], "aux_layer_ids": aux_ids,
              "last_layer_id": N, "hidden_size": H, "storage": storage, "dtype": storage.get("aux")}
    if pending and not (out / hs.HEADER).exists():
        atomic_write_json(out / hs.HEADER, {"stage": hs.STAGE, "complete": False, **header})
    runner = None  # vLLM's model runner, when this run launched the server that extracted
    full = False
    if pending:
        if world == 1:
            clean_temp_files(out)
        else:
            for s in pending:
                with contextlib.suppress(FileNotFoundError):
                    (out / f"{hs.TMP_PREFIX}{hs.shard_name(s['k'])}").unlink()
        # after the clean-up: a killed run's torn temp shard is no part of the store
        if cfg.stop_when_full and hs.store_bytes(out) > bound:
            return stopped_full(out, bound, plan)  # before a server is launched for nothing
        factory = backend_factory or make_backend
        backend = factory(cfg, num_layers=N, aux_ids=aux_ids, max_len=max(inp.lengths.values()))
        runner = getattr(backend, "model_runner", None)
        try:
            full = not extract_shards(backend, inp, pending, out, storage=cfg.storage, aux_ids=aux_ids, N=N,
                                      index=hs.index_name(rank, world), progress_every=cfg.progress_every,
                                      max_store=bound, bytes_per_token=bpt, stop_when_full=cfg.stop_when_full)
        finally:
            backend.close()  # a server this run launched is stopped (and waited for) here
    if full:
        return stopped_full(out, bound, plan)

    committed = hs.committed_shards(out)
    missing = [s["k"] for s in plan["shards"] if s["k"] not in committed]
    if missing:
        print(f"rank {rank}: my shards are done; {len(missing)} shard(s) of other ranks are still "
              "missing, so the manifest is left to the last rank to finish", file=sys.stderr)
        return 0
    entries = [committed[s["k"]] for s in plan["shards"]]
    counts = {"samples": plan["samples"], "tokens": plan["tokens"], "shards": len(entries),
              "bytes": sum(e["bytes"] for e in entries),
              "supervised_tokens": inp.manifest.get("counts", {}).get("supervised_tokens")}
    write_manifest(out, hs.STAGE, config=cfg.to_dict(), inputs={"training_set": inp.describe()},
                   outputs={"shards": [e["shard"] for e in entries]}, counts=counts,
                   **header, backend=cfg.backend, vllm_model_runner=runner,
                   layer_convention=("id i = residual stream entering layer i; "
                                     f"id {N} = last layer output before the final norm"))
    print(f"wrote {len(entries)} shards ({hs.human_bytes(counts['bytes'])}, {counts['tokens']} tokens, "
          f"{bpt} bytes/token) to {out}")
    return 0


def stopped_full(out: Path, bound: int, plan: dict) -> int:
    """--stop-when-full's ending: one line, exit 0 (the store is consistent: every shard in it is
    committed; a rerun goes on from its index)."""
    done = len(set(hs.committed_shards(out)) & {s["k"] for s in plan["shards"]})
    print(f"02: the store is full ({hs.human_bytes(hs.store_bytes(out))} on disk > --max-store-gb {bound / 1e9:g} GB): "
          f"stopped with {done} of {len(plan['shards'])} shards committed (--stop-when-full); rerun the same "
          "command once 04 --follow --consume has trained and deleted some", flush=True)
    hs.note(out / "progress.log", "02 extract", f"stopped full (--stop-when-full): {done} of "
                                                f"{len(plan['shards'])} shards committed")
    return 0


def make_backend(cfg, *, num_layers: int, aux_ids: Sequence[int], max_len: int | None = None):
    if cfg.backend == "vllm":
        from eagle3_train.extract.vllm import VllmBackend

        return VllmBackend(cfg, num_layers=num_layers, aux_ids=aux_ids, max_len=max_len)
    from eagle3_train.extract.hf import HFBackend

    return HFBackend(cfg, num_layers=num_layers, aux_ids=aux_ids)


def extract_shards(backend, inp: InputSet, shards: Sequence[dict], out: Path, *, storage: str,
                   aux_ids: Sequence[int], N: int, index: str, progress_every: float = 30.0,
                   max_store: int | None = None, bytes_per_token: int = 0, stop_when_full: bool = False) -> bool:
    """Compute and commit `shards` in order; the write of shard k overlaps the compute of k+1. With
    `max_store` (bytes), no shard's work is sent while the store's shards on disk and the one being
    written exceed it (hidden_store.wait_for_room): a follower that consumes shards makes room.
    `stop_when_full`: instead of that wait, commit the shard being written and return False (True:
    every shard done)."""
    total = sum(len(s["ids"]) for s in shards)
    meta = {"storage": storage, "layer_ids": [*aux_ids, N]}
    with Progress("02 extract", total, unit="sample", log_path=out / "progress.log", every_s=progress_every) as bar, \
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-writer") as pool:
        writing: Future | None = None
        # A backend that queues requests (vllm) gets the next shard's samples while it computes this
        # one's, so its workers never idle at a shard boundary.
        prefetch = getattr(backend, "prefetch", None)
        upcoming = inp.records(shards[0]["ids"]) if shards else []
        for i, shard in enumerate(shards):
            records, upcoming = upcoming, inp.records(shards[i + 1]["ids"]) if i + 1 < len(shards) else []
            ahead = 0
            if max_store is not None:
                writing_bytes = 0 if writing is None or writing.done() else shards[i - 1]["tokens"] * bytes_per_token
                if stop_when_full and hs.store_bytes(out) + writing_bytes > max_store:
                    if writing is not None:
                        writing.result()  # committed: on disk its real size, not the estimate
                        writing, writing_bytes = None, 0
                    if hs.store_bytes(out) > max_store:
                        return False
                # the shard being written counts until it is on disk (then as its real size), measured at every
                # poll: a bound below one shard still moves as a follower consumes
                w, est = writing, writing_bytes
                hs.wait_for_room(out, max_store, 0, log_path=out / "progress.log", stage="02 extract",
                                 every_s=progress_every, in_flight=lambda: 0 if w is None or w.done() else est)
                ahead = writing_bytes + shard["tokens"] * bytes_per_token
            if prefetch is not None:
                prefetch(records)
                # the next shard's requests go out early only when the bound has room for it too
                if max_store is None or hs.store_bytes(out) + ahead + sum(
                        len(r["input_ids"]) for r in upcoming) * bytes_per_token <= max_store:
                    prefetch(upcoming)
            parts: list[dict[str, torch.Tensor]] = []
            for batch in backend.batches(records):
                res = backend.run(batch)
                bad = hs.nonfinite(res["aux"]) + (hs.nonfinite(res["last"]) if "last" in res else 0)
                if bad:
                    raise PipelineError(
                        f"the target produced {bad} NaN/inf hidden-state values in shard {shard['k']} "
                        f"(samples {', '.join(r['id'] for r in batch[:3])}...); try --dtype bfloat16 or float32")
                ids = torch.tensor([t for r in batch for t in r["input_ids"]])
                mask = torch.tensor([m for r in batch for m in r["loss_mask"]])
                parts.append(hs.encode(storage, ids, mask, res["aux"], res.get("last"), res.get("topk")))
                bar.update(len(batch), tokens=len(ids))
            tensors = {name: torch.cat([p[name] for p in parts]) for name in parts[0]}
            samples = [{"id": r["id"], "length": len(r["input_ids"])} for r in records]
            if writing is not None:
                writing.result()
            writing = pool.submit(hs.write_shard, out, shard["k"], samples, tensors, index=index, meta=meta)
        if writing is not None:
            writing.result()
    return True
