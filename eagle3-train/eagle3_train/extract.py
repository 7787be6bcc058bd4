"""02's engine: run the target over the tokenized training set and store EAGLE-3's features.

Layer convention (DESIGN.md): id i = the residual stream entering decoder layer i (HF
`hidden_states[i]`, vLLM's aux id i); id N = the last layer's output *before* the final norm.
The `hf` backend captures exactly those tensors with forward pre-hooks (on layer i, and on the
final norm for id N), so no other layer's states are kept. The `vllm` backend (vllm_extract.py)
gets the same tensors from vLLM's `extract_hidden_states` method.

Flow: the input is scanned (ids, lengths, byte offsets, sha256); plan.json fixes which samples
go to which shard (first run only); each shard not yet committed (and, with several ranks, owned
by this rank: k % world_size == rank) is computed batch by batch, encoded (bf16 / fp8 / top-k),
written atomically and indexed; the manifest is written once every shard of the plan is in.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import hidden_store as hs
from .dataset import DATA
from .dataset import STAGE as TOKENIZE_STAGE
from .errors import PipelineError
from .manifest import describe_target, describe_tokenizer, read_manifest, text_config, write_manifest
from .progress import Progress
from .store import DirLock, clean_temp_files, move_aside
from .target_layout import check_vocab, load_config

MANIFEST_NAME = "manifest.json"
DISK_MARGIN = 1.02  # headers, index, plan: a few per cent on top of the tensor bytes


# ----------------------------------------------------------------------------- input

@dataclass
class InputSet:
    """The tokenized set, scanned once: ids in file order, lengths and byte offsets, sha256."""
    directory: Path
    path: Path
    manifest: dict
    ids: list[str] = field(default_factory=list)
    lengths: dict[str, int] = field(default_factory=dict)
    offsets: dict[str, int] = field(default_factory=dict)
    sha256: str = ""
    size: int = 0
    max_token_id: int = -1

    @classmethod
    def open(cls, directory: Path) -> InputSet:
        directory = Path(directory)
        manifest = read_manifest(directory, TOKENIZE_STAGE)
        path = directory / DATA
        if not path.exists():
            raise PipelineError(f"{path} is missing although its manifest says complete")
        self = cls(directory, path, manifest)
        h = hashlib.sha256()
        off = 0
        with open(path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                h.update(raw)
                if raw.strip():
                    rec = self._parse(raw, lineno)
                    sid = str(rec["id"])
                    if sid in self.lengths:
                        raise PipelineError(f"{path}:{lineno}: duplicate sample id {sid!r}")
                    self.ids.append(sid)
                    self.lengths[sid] = len(rec["input_ids"])
                    self.offsets[sid] = off
                    self.max_token_id = max(self.max_token_id, max(rec["input_ids"]))
                off += len(raw)
        self.sha256, self.size = h.hexdigest(), off
        if not self.ids:
            raise PipelineError(f"{path} has no samples")
        return self

    def _parse(self, raw: bytes, lineno: int | str) -> dict:
        try:
            rec = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise PipelineError(f"{self.path}:{lineno}: malformed JSON line") from None
        for key in ("id", "input_ids", "loss_mask"):
            if not isinstance(rec, dict) or key not in rec:
                raise PipelineError(f"{self.path}:{lineno}: record has no {key!r}")
        if len(rec["input_ids"]) != len(rec["loss_mask"]):
            raise PipelineError(f"{self.path}:{lineno}: sample {rec['id']} has {len(rec['input_ids'])} "
                                f"input_ids but {len(rec['loss_mask'])} loss_mask entries")
        if not rec["input_ids"]:
            raise PipelineError(f"{self.path}:{lineno}: sample {rec['id']} has no tokens")
        return rec

    @property
    def tokenizer(self) -> dict:
        return self.manifest.get("tokenizer") or {}

    @property
    def tokens(self) -> int:
        return sum(self.lengths.values())

    def records(self, ids: Sequence[str]) -> list[dict]:
        out = []
        with open(self.path, "rb") as f:
            for sid in ids:
                f.seek(self.offsets[sid])
                out.append(self._parse(f.readline(), f"offset {self.offsets[sid]}"))
        return out

    def expected(self, sid: str) -> tuple[list | None, list | None]:
        if sid not in self.offsets:
            return None, None
        rec = self.records([sid])[0]
        return rec["input_ids"], rec["loss_mask"]

    def describe(self) -> dict:
        return {"path": str(self.path.resolve()), "size": self.size, "sha256": self.sha256,
                "samples": len(self.ids), "tokens": self.tokens}


# ----------------------------------------------------------------------------- layers

def default_aux_layers(num_layers: int) -> list[int]:
    """vLLM's EAGLE-3 default: (2, N // 2, N - 3)."""
    return [2, num_layers // 2, num_layers - 3]


def parse_layers(spec: str | None, num_layers: int) -> list[int]:
    if not spec:
        ids = default_aux_layers(num_layers)
    else:
        try:
            ids = [int(x) for x in spec.replace(" ", "").split(",") if x]
        except ValueError:
            raise PipelineError(f"--layers {spec!r}: expected comma-separated layer ids, e.g. 2,30,58") from None
    bad = [i for i in ids if not 0 <= i <= num_layers]
    if not ids or bad:
        raise PipelineError(f"--layers {spec!r}: ids must lie in 0..{num_layers} (the target has "
                            f"{num_layers} layers; id {num_layers} is the last layer's output)")
    return ids


# ----------------------------------------------------------------------------- hf backend

def find_stack(model, num_layers: int):
    """(decoder module, its layer list, its final norm) of the language model inside `model`
    (works through multimodal wrappers such as Kimi-K2.5's)."""
    found = []
    for name, mod in model.named_modules():
        layers = getattr(mod, "layers", None)
        if isinstance(layers, torch.nn.ModuleList) and len(layers) == num_layers and hasattr(mod, "norm"):
            found.append((name, mod))
    if not found:
        raise PipelineError(f"cannot find a stack of {num_layers} decoder layers with a final norm "
                            f"in {type(model).__name__}")
    # A multimodal wrapper may have a vision tower with the same shape; prefer the language model.
    found.sort(key=lambda nm: ("vision" in nm[0] or "visual" in nm[0], len(nm[0])))
    mod = found[0][1]
    return mod, mod.layers, mod.norm


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    if torch.cuda.is_available():
        return f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
    return "cpu"


def resolve_dtype(name: str, device: str) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return hs.DTYPES[name]


class HFTarget:
    """The target in transformers, with pre-hooks that keep only the layers EAGLE-3 needs."""

    def __init__(self, path: str, *, num_layers: int, aux_ids: Sequence[int], storage: str, topk: int,
                 dtype: torch.dtype, device: str, device_map: str | None = None):
        from .target_layout import load_model

        kw = {"dtype": dtype, "trust_remote_code": True}
        if device_map:
            kw["device_map"] = device_map
        try:
            model = load_model(path, **kw)
        except (OSError, ValueError) as e:
            raise PipelineError(f"cannot load target {path!r}: {str(e).splitlines()[0]}") from None
        if not device_map:
            model.to(device)
        self.model = model.eval()
        self.num_layers = num_layers
        self.aux_ids = list(aux_ids)
        self.topk = topk if storage == "fp8-topk" else 0
        self.base, layers, self.norm = find_stack(model, num_layers)
        self.lm_head = model.get_output_embeddings().weight if self.topk else None
        self.layers = layers
        self._captured: dict[int, torch.Tensor] = {}
        self._handles = []
        self.install_hooks()
        self.input_device = model.get_input_embeddings().weight.device

    def install_hooks(self) -> None:
        """One pre-hook per needed id: on layer i (its input) and, for id N, on the final norm."""
        self.remove_hooks()
        need = set(self.aux_ids) | (set() if self.topk else {self.num_layers})
        for i in sorted(need):
            mod = self.norm if i == self.num_layers else self.layers[i]
            self._handles.append(mod.register_forward_pre_hook(self._hook(i), with_kwargs=True))

    def _hook(self, layer_id: int):
        def pre_hook(module, args, kwargs):
            self._captured[layer_id] = args[0] if args else kwargs["hidden_states"]
        return pre_hook

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    @staticmethod
    def pad(records: Sequence[dict]) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        lens = [len(r["input_ids"]) for r in records]
        T = max(lens)
        ids = torch.zeros(len(records), T, dtype=torch.long)
        valid = torch.zeros(len(records), T, dtype=torch.bool)
        for b, r in enumerate(records):
            ids[b, : lens[b]] = torch.tensor(r["input_ids"], dtype=torch.long)
            valid[b, : lens[b]] = True
        return ids, (None if bool(valid.all()) else valid.long()), valid

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, mask: torch.Tensor | None):
        return self.base(input_ids=ids.to(self.input_device),
                         attention_mask=None if mask is None else mask.to(self.input_device),
                         use_cache=False)

    @torch.inference_mode()
    def run(self, records: Sequence[dict]) -> dict:
        """{'aux' [M, n_aux, H], 'last' [M, H] or 'topk' (ids, logprobs)} on the CPU, M = the
        records' tokens concatenated in order (padding removed)."""
        ids, mask, valid = self.pad(records)
        self._captured.clear()
        try:
            out = self.forward(ids, mask)
            rows = {i: t[valid.to(t.device)].cpu() for i, t in self._captured.items()}
            result = {"aux": torch.stack([rows[i] for i in self.aux_ids], dim=1)}
            if self.topk:
                post = out.last_hidden_state[valid.to(out.last_hidden_state.device)]
                result["topk"] = topk_logprobs(post, self.lm_head, self.topk)
            else:
                result["last"] = rows[self.num_layers]
        finally:
            self._captured.clear()
        return result


def topk_logprobs(h: torch.Tensor, weight: torch.Tensor, k: int, budget: int = 1 << 28
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of log_softmax(h @ weight.T) per row, in row chunks so that a 160K vocabulary never
    needs more than `budget` logits at once. `h` is the *normed* final hidden state."""
    step = max(1, budget // weight.shape[0])
    ids, lps = [], []
    for a in range(0, h.shape[0], step):
        logits = torch.nn.functional.linear(h[a: a + step].to(weight.device, weight.dtype), weight).float()
        v, i = torch.log_softmax(logits, dim=-1).topk(k, dim=-1)
        ids.append(i.cpu())
        lps.append(v.cpu())
    return torch.cat(ids), torch.cat(lps)


def token_batches(records: Sequence[dict], batch_tokens: int, max_batch_size: int) -> Iterator[list[dict]]:
    """Consecutive records grouped so that batch size x longest length <= batch_tokens."""
    batch: list[dict] = []
    longest = 0
    for r in records:
        n = len(r["input_ids"])
        if batch and (len(batch) >= max_batch_size or (len(batch) + 1) * max(longest, n) > batch_tokens):
            yield batch
            batch, longest = [], 0
        batch.append(r)
        longest = max(longest, n)
    if batch:
        yield batch


class HFBackend:
    name = "hf"

    def __init__(self, args, *, num_layers: int, aux_ids: Sequence[int], max_len: int | None = None):
        device = resolve_device(args.device)
        self.dtype = resolve_dtype(args.dtype, device)
        self.args = args
        self.target = HFTarget(args.model, num_layers=num_layers, aux_ids=aux_ids, storage=args.storage,
                               topk=args.topk, dtype=self.dtype, device=device, device_map=args.device_map)

    def batches(self, records):
        return token_batches(records, self.args.batch_tokens, self.args.max_batch_size)

    def run(self, records):
        return self.target.run(records)

    def close(self):
        self.target.remove_hooks()


# ----------------------------------------------------------------------------- driver

def rank_and_world(args) -> tuple[int, int]:
    rank = args.rank if args.rank is not None else int(os.environ.get("RANK", 0))
    world = args.world_size if args.world_size is not None else int(os.environ.get("WORLD_SIZE", 1))
    if world < 1 or not 0 <= rank < world:
        raise PipelineError(f"--rank {rank} must lie in 0..{world - 1} (--world-size {world})")
    return rank, world


def target_info(model: str) -> tuple[dict, object]:
    try:
        cfg = load_config(model)
    except (OSError, ValueError) as e:
        raise PipelineError(f"cannot read the target's config at {model!r}: {str(e).splitlines()[0]}") from None
    return describe_target(cfg, model), text_config(cfg)


def check_tokenizer(args, inp: InputSet) -> dict:
    from .tokenization import load_tokenizer

    name = args.tokenizer or args.model
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
                problems = hs.validate_shard(out, committed[k], storage=storage, n_aux=n_aux, hidden=hidden,
                                             topk=topk, expected=inp.expected if inp else None)
                planned = plan["shards"][k]["ids"]
                if committed[k]["ids"] != planned:
                    problems.append("its samples differ from plan.json")
                if problems:
                    bad[k] = problems
            bar.update(1, errors=int(k in bad))
    return bad


def run(args, *, backend_factory=None) -> int:
    """The whole stage for one process (rank). Returns the exit code."""
    rank, world = rank_and_world(args)
    out = Path(args.output)
    if args.overwrite and world > 1:
        raise PipelineError("--overwrite moves the output aside, which several ranks cannot do together; "
                            "run once with a single process and --overwrite, or move it yourself")
    if (args.validate or args.repair) and not (out / hs.PLAN).exists():
        raise PipelineError(f"{out} holds no extraction (no {hs.PLAN}): nothing to validate")
    out.mkdir(parents=True, exist_ok=True)
    lock = DirLock(out, hs.STAGE) if world == 1 else DirLock(out / ".locks" / f"rank-{rank}", hs.STAGE)
    with lock:
        if args.overwrite and not (args.validate or args.repair) and (old := move_aside(out)):
            print(f"moved the previous output to {old}", file=sys.stderr)
        return _run_locked(args, out, rank, world, backend_factory)


def _run_locked(args, out: Path, rank: int, world: int, backend_factory) -> int:
    inp = InputSet.open(args.input)
    target, cfg = target_info(args.model)
    tokenizer = check_tokenizer(args, inp)
    check_vocab(cfg.vocab_size, tokenizer["vocab_size"], args.model)
    N, H = int(cfg.num_hidden_layers), int(cfg.hidden_size)
    if inp.max_token_id >= int(cfg.vocab_size):
        raise PipelineError(f"{inp.path} has token id {inp.max_token_id}, outside the target's vocabulary "
                            f"of {cfg.vocab_size}")
    aux_ids = parse_layers(args.layers, N)
    if args.storage not in hs.STORAGES:
        raise PipelineError(f"--storage {args.storage!r}: choose one of {', '.join(hs.STORAGES)}")
    topk = args.topk if args.storage == "fp8-topk" else 0
    if topk > int(cfg.vocab_size):
        raise PipelineError(f"--topk {topk} exceeds the target's vocabulary of {cfg.vocab_size}")
    bpt = hs.bytes_per_token(args.storage, len(aux_ids), H, topk)
    storage = hs.describe_storage(args.storage, len(aux_ids), H, topk)
    key = {"input_sha256": inp.sha256, "target": target, "aux_layer_ids": aux_ids,
           "storage": args.storage, "topk": topk, "shard_tokens": hs.shard_tokens_for(args.shard_mb, bpt)}
    plan = hs.load_or_create_plan(out, key, lambda: hs.make_plan(
        [(sid, inp.lengths[sid]) for sid in inp.ids], key["shard_tokens"]))
    vcheck = {"storage": args.storage, "n_aux": len(aux_ids), "hidden": H, "topk": topk}

    if args.validate:
        bad = validate(out, plan, inp, **vcheck)
        if bad:
            first = next(iter(bad.items()))
            raise PipelineError(f"{len(bad)} of {len(plan['shards'])} shards in {out} failed validation "
                                f"(first: {hs.shard_name(first[0])}: {first[1][0]}); rerun with --repair "
                                "to redo them")
        print(f"validated {len(plan['shards'])} shards, {plan['samples']} samples, {plan['tokens']} tokens: OK")
        return 0

    mine = [s for s in plan["shards"] if s["k"] % world == rank]
    if args.repair:
        committed = hs.committed_shards(out)
        bad = validate(out, plan, inp, shards=[s["k"] for s in mine if s["k"] in committed], **vcheck)
        if bad:
            with contextlib.suppress(FileNotFoundError):
                (out / MANIFEST_NAME).unlink()
            hs.drop_shards(out, sorted(bad), index=hs.index_name(rank, world))
            print(f"repair: {len(bad)} bad shard(s) moved aside and will be redone: "
                  + ", ".join(hs.shard_name(k) for k in sorted(bad)), file=sys.stderr)

    committed = hs.committed_shards(out)
    pending = [s for s in mine if s["k"] not in committed]
    if not pending and (out / MANIFEST_NAME).exists():
        print(f"{out} is already complete ({plan['samples']} samples); nothing to do")
        return 0
    need = sum(s["tokens"] for s in pending) * bpt
    disk_check(out, need, force=args.force,
               what=f"{sum(s['tokens'] for s in pending)} tokens x {bpt} bytes/token ({args.storage})")

    if pending:
        if world == 1:
            clean_temp_files(out)
        else:
            for s in pending:
                with contextlib.suppress(FileNotFoundError):
                    (out / f"{hs.TMP_PREFIX}{hs.shard_name(s['k'])}").unlink()
        factory = backend_factory or make_backend
        backend = factory(args, num_layers=N, aux_ids=aux_ids, max_len=max(inp.lengths.values()))
        try:
            extract_shards(backend, inp, pending, out, storage=args.storage, aux_ids=aux_ids, N=N,
                           index=hs.index_name(rank, world))
        finally:
            backend.close()

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
    write_manifest(out, hs.STAGE, config=vars(args), inputs={"training_set": inp.describe()},
                   outputs={"shards": [e["shard"] for e in entries]}, counts=counts,
                   target=target, tokenizer=tokenizer, layer_ids=[*aux_ids, N], aux_layer_ids=aux_ids,
                   last_layer_id=N, hidden_size=H, storage=storage, dtype=storage.get("aux"),
                   backend=args.backend, layer_convention=("id i = residual stream entering layer i; "
                                                           f"id {N} = last layer output before the final norm"))
    print(f"wrote {len(entries)} shards ({hs.human_bytes(counts['bytes'])}, {counts['tokens']} tokens, "
          f"{bpt} bytes/token) to {out}")
    return 0


def make_backend(args, *, num_layers: int, aux_ids: Sequence[int], max_len: int | None = None):
    if args.backend == "hf":
        return HFBackend(args, num_layers=num_layers, aux_ids=aux_ids)
    if args.backend == "vllm":
        from .vllm_extract import VllmBackend

        return VllmBackend(args, num_layers=num_layers, aux_ids=aux_ids, max_len=max_len)
    raise PipelineError(f"--backend {args.backend!r}: choose hf or vllm")


def extract_shards(backend, inp: InputSet, shards: Sequence[dict], out: Path, *, storage: str,
                   aux_ids: Sequence[int], N: int, index: str) -> None:
    """Compute and commit `shards` in order; the write of shard k overlaps the compute of k+1."""
    total = sum(len(s["ids"]) for s in shards)
    meta = {"storage": storage, "layer_ids": [*aux_ids, N]}
    with Progress("02 extract", total, unit="sample", log_path=out / "progress.log") as bar, \
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-writer") as pool:
        writing: Future | None = None
        for shard in shards:
            records = inp.records(shard["ids"])
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
