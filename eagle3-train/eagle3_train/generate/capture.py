"""01b --capture-hidden-states: the target's features kept while it generates, in 02's store format.

The server is 02's extractor (extract/vllm.py server_args: the `extract_hidden_states` method and
`ExampleHiddenStatesConnector`) serving chat completions. Each request carries
`kv_transfer_params: {"include_output_tokens": true}`, so the connector saves the aux states of the
prompt *and* the answer: T - 1 rows for the T = prompt + generated ids (vLLM 0.32,
example_hidden_states_connector.py request_finished: `all_token_ids[:-1]`; the last sampled token
is never fed through the model), and the response's top-level `kv_transfer_params.hidden_states_path`
names the file.

Rows vs 01c's sequence. 01c's input_ids are exactly `prompt_token_ids + token_ids` (the server's own
ids, never the re-rendered text), cut to --max-seq-len, so file row t is the state of input_ids[t]
for t < T - 1. The final position T - 1 (the answer's last token, `<|im_end|>` or the max_tokens
cut) has no state; the store keeps a zero row there, so every store sample has as many rows as
01c's record (02's format). Nothing reads it: 04 pairs aux[t] with token t+1 (aux[:-1]) and takes
the target at t only where token t+1 exists in the sample (acceptance.draft_correctness), so neither
the aux nor the target (last / top-k) of a sample's final row reaches a loss or an acceptance count.
A sample cut by --max-seq-len keeps real rows only.

Which answers get a store sample: those 01c keeps with the same settings (build_training_set: not
an empty answer, not a max_tokens cut under --drop-length, some supervised token); the others are
committed as answers marked `"captured": false`.

Commit order (kill -9 at any moment, then rerun: every id once in answers and store):
  1. an answer's file is read (after the connector's lock), cut and encoded, then deleted; a missing
     or unusable file re-asks the same request (--max-retries times, counted), then is an error;
  2. answers wait in memory until they fill a shard (--shard-mb); then, on one writer thread:
     journal `hidden/.capture/shard-K.jsonl` (the shard's answer records, atomic) ->
     the shard file + its index line (hs.write_shard: the commit point) ->
     the answers appended to raw_responses.jsonl (fsynced) -> the journal deleted.
  3. on every start (Capture.open): a journal whose shard is committed is replayed into the answers
     (ids not there yet), any other journal is dropped (its answers are asked again); a committed
     shard holding an id that has no answer is uncommitted (hs.drop_shards); an answer marked
     captured whose states are not in the store is taken out of the answers (asked again, counted);
     temp files (the store's and the journals') and shard files no index line commits are deleted.
A kill loses at most the answers buffered for the shard being filled; they are asked again.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import shlex
import sys
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from eagle3_train.common import hidden_store as hs
from eagle3_train.common.client import Outcome
from eagle3_train.common.errors import PipelineError
from eagle3_train.common.formats import TOPK_STORAGE
from eagle3_train.common.manifest import MANIFEST, describe_file, describe_tokenizer, write_manifest
from eagle3_train.common.store import (
    TMP_PREFIX,
    JsonlWriter,
    atomic_write_json,
    atomic_write_text,
    clean_temp_files,
    fsync_dir,
    read_jsonl,
)
from eagle3_train.extract import vllm as vx
from eagle3_train.generate.capture_client import CaptureClient, extra_body
from eagle3_train.generate.capture_settings import HIDDEN, REQUESTS

JOURNAL = ".capture"
CAPTURED = "during generation (01b --capture-hidden-states)"
FINAL_ROW = ("zeros: the answer's last token is never fed through the target; nothing reads it (04 and 05 "
             "take no target where no token follows)")
LOCK_WAIT_S = 600.0  # longest wait for the connector to finish writing one file

# The longest context 01b capture asks of a server it launches or prints without --max-model-len.
LONGEST_UNASKED_CONTEXT = 32768


def store_sequence(sample: dict, fmt, cfg):
    """01c's training sequence for `sample` (tokenization.Tokenized), or None when 01c drops it
    (tokenize/dataset.py:training_sequence, the one rule)."""
    from eagle3_train.tokenize.dataset import training_sequence

    t, dropped = training_sequence(sample, fmt, max_seq_len=cfg.max_seq_len, loss_on=cfg.loss_on,
                                   keep_length=cfg.keep_length)
    return None if dropped else t


def store_rows(aux: torch.Tensor, last: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The file's T - 1 rows as the store's `length` rows (length <= T): cut, or (length == T) the
    final row added as zeros (see the module doc)."""
    rows = min(length, aux.shape[0])
    aux, last = aux[:rows], last[:rows]
    if length > rows:
        pad = length - rows
        aux = torch.cat([aux, aux.new_zeros(pad, *aux.shape[1:])])
        last = torch.cat([last, last.new_zeros(pad, *last.shape[1:])])
    return aux, last


class Capture:
    """The capture side of one 01b run: `Capture(cfg, out)` (checks, no writes) -> `open(raw)`
    (repairs after a kill) -> `collect`/`add` per answer -> `close()` -> `finalize(raw)`."""

    client_class = CaptureClient
    extra_body = staticmethod(extra_body)

    def __init__(self, cfg, out_dir: Path, fmt=None):
        from eagle3_train.common.target import target_info
        from eagle3_train.common.target_layout import check_vocab
        from eagle3_train.common.tokenization import chat_format_from_args
        from eagle3_train.extract.stage import parse_layers

        self.cfg = cfg
        self.name = cfg.target or cfg.model
        self.target, tcfg = target_info(self.name)
        self.N, self.H, vocab = int(tcfg.num_hidden_layers), int(tcfg.hidden_size), int(tcfg.vocab_size)
        self.aux_ids = parse_layers(cfg.layers, self.N)
        self.layer_ids = vx.vllm_layer_ids(self.aux_ids, self.N)
        self.topk = cfg.topk if cfg.storage == TOPK_STORAGE else 0
        if self.topk > vocab:
            raise PipelineError(f"--topk {self.topk} exceeds the target's vocabulary of {vocab}")
        self.bpt = hs.bytes_per_token(cfg.storage, len(self.aux_ids), self.H, self.topk)
        self.shard_tokens = hs.shard_tokens_for(cfg.shard_mb, self.bpt)
        # 01b's --tokenize loaded one already (from --tokenizer or --model): the same unless --target names another
        same = fmt is not None and (cfg.tokenizer or cfg.model) == (cfg.tokenizer or self.name)
        self.fmt = fmt if same else chat_format_from_args(cfg, default_tokenizer=self.name)
        self.tokenizer = describe_tokenizer(self.fmt.tokenizer, cfg.tokenizer or self.name)
        check_vocab(vocab, self.tokenizer["vocab_size"], self.name)
        self.dir = Path(out_dir) / HIDDEN
        self.own_requests = cfg.hidden_states_dir is None
        self.req_dir = Path(cfg.hidden_states_dir or Path(out_dir) / REQUESTS).resolve()
        context = int(getattr(tcfg, "max_position_embeddings", 0) or 8192)
        if cfg.max_model_len is None and not cfg.base_url and context > LONGEST_UNASKED_CONTEXT:
            # vLLM would be asked for the target's whole context (Kimi: 262,144 tokens) and, with the
            # hidden-state cache beside the KV cache, refuse it only after loading the weights
            raise PipelineError(f"--capture-hidden-states without --max-model-len would start vLLM at the target's "
                                f"full context of {context:,} tokens, which it refuses only after loading the "
                                f"weights: pass --max-model-len (the longest prompt + --max-tokens, e.g. 32768)")
        self.max_model_len = cfg.max_model_len or context
        if cfg.max_seq_len is None:  # 01c's cut, needed per answer as it arrives: no answer passes the server's
            # context, so none is cut; a run recorded with a value resumes with it
            from eagle3_train.common.rerun import read_record

            was = {} if cfg.overwrite else ((read_record(out_dir) or {}).get("inputs") or {}).get("capture") or {}
            cfg.max_seq_len = was.get("max_seq_len") or self.max_model_len
        self.meta = {"storage": cfg.storage, "layer_ids": [*self.aux_ids, self.N]}
        self.stats = Counter()
        self.head = None
        self.server = None
        self.raw: JsonlWriter | None = None
        self._buffer: list[tuple[dict, dict | None]] = []
        self._buffer_tokens = 0
        self._reading: set[str] = set()
        self._readers = ThreadPoolExecutor(max_workers=4, thread_name_prefix="capture-read")
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="capture-write")
        self._flushes: list[Future] = []
        self._unwritten: dict[Future, int] = {}  # shards handed to the writer: their bytes, until on disk
        if cfg.max_store_gb:
            self.client_class = functools.partial(CaptureClient, room=self.room)
        self._head_bytes = vx.head_bytes(tcfg)
        if cfg.storage == TOPK_STORAGE:  # read now, so a bad checkpoint fails at once; placed by _place_head
            from eagle3_train.common.target import local_model_dir

            self.head = vx.CheckpointHead(local_model_dir(self.name, what="--target"), tcfg, "cpu")

    # ------------------------------------------------------------------------- identity and server

    def identity(self) -> dict:
        """What the store is made of, as resolved (rerun inputs: a resume must match it)."""
        c = self.cfg
        return {"capture": {"target": self.target, "aux_layer_ids": self.aux_ids, "storage": c.storage,
                            "topk": self.topk, "tokenizer": self.tokenizer["fingerprint"],
                            "max_seq_len": c.max_seq_len, "loss_on": c.loss_on, "keep_length": c.keep_length}}

    def serve_command(self) -> str:
        c = self.cfg
        cmd = vx.serve_command(self.name, self.layer_ids, self.req_dir, max_model_len=self.max_model_len,
                               tensor_parallel_size=c.tensor_parallel_size,
                               served_name=c.model if c.model != self.name else None,
                               max_num_batched_tokens=c.max_num_batched_tokens, max_num_seqs=c.most_in_flight)
        return cmd + (f" {c.vllm_args}" if c.vllm_args else "")

    @contextlib.contextmanager
    def serving(self, log_path: Path):
        """With --launch-server and no --base-url: the server for the duration of the block."""
        c = self.cfg
        if not c.base_url and not c.launch_server:
            print(f"start the generation server (on the GPU box) with:\n\n  {self.serve_command()}\n")
            raise PipelineError("--capture-hidden-states needs a server started with the command printed above: "
                                "start it, then rerun with --base-url http://127.0.0.1:8000/v1 (or pass "
                                "--launch-server)")
        if c.base_url:
            self._place_head()
            yield
            return
        from eagle3_train.common.vllm_server import VllmServer

        self.req_dir.mkdir(parents=True, exist_ok=True)
        self.server = VllmServer(self.name, served_name=c.model, reasoning_parser=None,
                                 max_model_len=self.max_model_len, log_path=log_path,
                                 startup_timeout=c.startup_timeout,
                                 extra_args=vx.server_args(self.layer_ids, self.req_dir,
                                                           tensor_parallel_size=c.tensor_parallel_size,
                                                           max_num_batched_tokens=c.max_num_batched_tokens,
                                                           max_num_seqs=c.most_in_flight, model=self.name)
                                 + shlex.split(c.vllm_args or ""))
        print(f"starting vLLM: {self.server.command_line()}", file=sys.stderr)
        self.server.start()
        c.base_url = [self.server.base_url]
        try:
            self._place_head()
            yield
        finally:
            self.server.stop()  # --base-url keeps the launched server's URL: the manifest names it

    def _place_head(self) -> None:
        """The top-k head onto its device once the server is up: before, every GPU looks free and
        `auto` would pick the one vLLM then fills to --gpu-memory-utilization."""
        if self.head is not None:
            device = vx.head_device(self.cfg.device, self._head_bytes)
            print(f"01b: the top-k head (final norm + lm_head) runs on {device}", file=sys.stderr)
            self.head.to(device)

    # ------------------------------------------------------------------------- start: repair

    def open(self, raw_path: Path, requested=()) -> None:
        """Make the answers and the store agree after whatever stopped the last run (module doc, 3);
        `requested`: the prompt ids this run asks for (header.json's expected_samples)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / JOURNAL).mkdir(exist_ok=True)
        clean_temp_files(self.dir)
        clean_temp_files(self.dir / JOURNAL)  # a journal torn by kill -9 inside its atomic write
        raw_ids = {r["id"] for r in read_jsonl(raw_path) if "id" in r}
        committed = hs.committed_shards(self.dir)
        journals = sorted((self.dir / JOURNAL).glob("shard-*.jsonl"))
        replay = [r for j in journals if _journal_k(j) in committed for r in read_jsonl(j)
                  if r.get("id") not in raw_ids]
        if replay:
            with JsonlWriter(raw_path) as w:
                for r in replay:
                    if r["id"] not in raw_ids:
                        w.write(r)
                        raw_ids.add(r["id"])
            self.stats["replayed"] += len(replay)
        for j in journals:
            j.unlink()
        orphans = sorted(k for k, e in committed.items() if any(i not in raw_ids for i in e["ids"]))
        if orphans:  # cannot come from this stage's order; an edited answers file: their answers are redone
            hs.drop_shards(self.dir, orphans)
            self.stats["dropped_shards"] += len(orphans)
            committed = hs.committed_shards(self.dir)
        # kill -9 between a shard's rename and its index line (hs.write_shard): a file no line commits
        names = {e["shard"] for e in committed.values()}
        for p in self.dir.glob("shard-*.safetensors"):  # hs.shard_name; bad-* (dropped) are kept
            if p.name not in names:
                p.unlink()
        stored: dict[str, int] = {}
        for k, e in committed.items():
            for i in e["ids"]:
                if i in stored:
                    raise PipelineError(f"{self.dir}: sample {i} is in shards {stored[i]} and {k}; the store was "
                                        "edited by hand: pass --overwrite to start over")
                stored[i] = k
        lost = {r["id"] for r in read_jsonl(raw_path) if r.get("captured") and r.get("id") not in stored}
        if lost:
            _rewrite_without(raw_path, lost)
            self.stats["asked_again"] += len(lost)
            print(f"01b: {len(lost)} answers have no states in {self.dir} (a shard was dropped or lost); "
                  "asking them again", file=sys.stderr)
        entries = list(read_jsonl(self.dir / hs.INDEX))
        self._next_k = 1 + max((e["k"] for e in entries), default=-1)
        (self.dir / MANIFEST).unlink(missing_ok=True)  # complete again only when finalize() says so
        # and planned again only then: a follower that saw the last finish's plan would take this growing
        # store as finished (the rerun after failed ids, or a larger --limit)
        (self.dir / hs.PLAN).unlink(missing_ok=True)
        # what the manifest will say of the format, before the first shard (02 does the same): a follower checks
        # it; and the samples to expect (this run's ids and those answered before, less the answers without
        # states), from which 04 --follow estimates its steps (it sees no plan.json until the end)
        answered = {r["id"]: r.get("captured") for r in read_jsonl(raw_path) if "id" in r}
        expected = len(set(requested) | set(answered)) - sum(1 for c in answered.values() if c is False)
        atomic_write_json(self.dir / hs.HEADER, {"stage": hs.STAGE, "complete": False, **self.header(),
                                                 "expected_samples": expected})
        if self.own_requests and self.req_dir.is_dir():  # files of requests a killed run never collected
            for p in self.req_dir.iterdir():
                vx.remove_request_file(p) if p.is_file() else None
        self.req_dir.mkdir(parents=True, exist_ok=True)
        self.raw = JsonlWriter(raw_path, fsync=False)

    # ------------------------------------------------------------------------- per answer

    async def collect(self, prompt, out: Outcome, ask_again) -> tuple[Outcome, dict | None]:
        """(outcome, the sample's encoded store tensors, or None when 01c drops it). A missing or
        unusable file sends the request again (`ask_again()`), up to --max-retries times; then the
        outcome is an error (errors.jsonl), never an answer without states."""
        for attempt in range(self.cfg.max_retries + 1):
            if not out.ok:
                return out, None
            path = out.answer.pop("hidden_states_path")
            sample = {"id": prompt.id, "messages": prompt.messages, **out.answer}
            self._reading.add(path)
            try:
                return out, await asyncio.get_running_loop().run_in_executor(self._readers, self._read, sample, path)
            except PipelineError as e:
                problem = str(e)
            finally:
                self._reading.discard(path)
            if attempt < self.cfg.max_retries:  # counted only when the request really goes again
                self.stats["states_reasked"] += 1
                out = await ask_again()
        return Outcome(error={"error_type": "hidden_states", "message": problem, "status": 200, "retryable": True,
                              "attempts": out.attempts, "endpoint": out.endpoint},
                       attempts=out.attempts, endpoint=out.endpoint, latency_s=out.latency_s), None

    def _read(self, sample: dict, path: str) -> dict | None:
        """On a reader thread: the file -> 01c's rows, encoded as the store keeps them; the file is
        deleted either way."""
        try:
            t = store_sequence(sample, self.fmt, self.cfg)
            if t is None:
                vx.wait_unlocked(path, LOCK_WAIT_S)  # deleted only once written, or it would come back
                return None
            full = list(sample["prompt_token_ids"]) + list(sample["token_ids"])
            got = vx.read_request_file(path, token_ids=full[:-1], layer_ids=self.layer_ids, aux_ids=self.aux_ids,
                                       num_layers=self.N, hidden_size=self.H, timeout=LOCK_WAIT_S)
        finally:
            vx.remove_request_file(path)
        aux, last = store_rows(got["aux"], got["last"], len(t.input_ids))
        bad = hs.nonfinite(aux) + hs.nonfinite(last)
        if bad:
            raise PipelineError(f"the target produced {bad} NaN/inf hidden-state values for sample {sample['id']}")
        topk = self.head(last, self.topk) if self.head is not None else None
        tensors = hs.encode(self.cfg.storage, torch.tensor(t.input_ids), torch.tensor(t.loss_mask), aux,
                            None if topk is not None else last, topk)
        return {"length": len(t.input_ids), "tensors": tensors}

    def add(self, rec: dict, states: dict | None) -> None:
        """Queue one answer (with its states, or None when 01c drops it); a full shard is committed
        on the writer thread. Synchronous, so a record is queued whole or not at all."""
        for f in self._flushes:
            if f.done() and f.exception() is not None:
                raise f.exception()
        self._flushes = [f for f in self._flushes if not f.done()]
        self._unwritten = {f: b for f, b in self._unwritten.items() if not f.done()}
        rec["captured"] = states is not None
        n = states["length"] if states else 0
        if n and self._buffer_tokens and self._buffer_tokens + n > self.shard_tokens:
            self._flush()
        self._buffer.append((rec, states))
        self._buffer_tokens += n

    def _flush(self) -> None:
        if self._buffer:
            batch, k = self._buffer, self._next_k
            self._next_k += any(s is not None for _, s in batch)
            self._buffer, self._buffer_tokens = [], 0
            f = self._writer.submit(self._commit, batch, k)
            self._flushes.append(f)
            self._unwritten[f] = sum(s["length"] for _, s in batch if s is not None) * self.bpt

    def room(self) -> None:
        """--max-store-gb: return once the store's shard bytes, the shards handed to the writer and the
        connector's per-request files (answers the server saved, not yet read into a shard) fit the
        bound. The shard being filled is not counted (only its commit lets 04 --consume free room:
        counting it could wait forever), so the store and the connector's directory hold at most the
        bound, one shard and the --concurrency answers in flight."""
        # measured again at every poll: a shard counted while the writer had it is on disk (or consumed)
        # once written, and counted twice or for ever otherwise (a bound below one shard never freed)
        hs.wait_for_room(self.dir, int(self.cfg.max_store_gb * 1e9), 0, log_path=self.dir / "progress.log",
                         stage="01b capture", in_flight=lambda: self.unwritten_bytes() + self.requests_on_disk())

    def unwritten_bytes(self) -> int:
        """Bytes of the shards handed to the writer and not yet on disk."""
        return sum(b for f, b in list(self._unwritten.items()) if not f.done())

    def requests_on_disk(self) -> int:
        """Bytes of the per-request files in the connector's directory. Those of requests no run will
        collect are swept first, so a leftover cannot hold the bound for ever."""
        self._sweep()
        return hs.request_bytes(self.req_dir)

    def _commit(self, batch: list[tuple[dict, dict | None]], k: int) -> None:
        """On the writer thread: journal -> shard + index line -> answers -> journal gone."""
        kept = [(r, s) for r, s in batch if s is not None]
        journal = self.dir / JOURNAL / f"shard-{k:05d}.jsonl"
        if kept:
            atomic_write_text(journal, "".join(json.dumps(r, ensure_ascii=False, separators=(",", ":")) + "\n"
                                               for r, _ in batch))
            names = kept[0][1]["tensors"]
            tensors = {n: torch.cat([s["tensors"][n] for _, s in kept]) for n in names}
            hs.write_shard(self.dir, k, [{"id": r["id"], "length": s["length"]} for r, s in kept], tensors,
                           meta=self.meta)
        for r, _ in batch:
            self.raw.write(r)
        self.raw.sync()
        journal.unlink(missing_ok=True)
        self.stats["shards"] += bool(kept)
        self._sweep()

    def _sweep(self) -> None:
        """Files of requests this run never collected (a client-side timeout: vLLM still saves the
        aborted request's states) are deleted once old, so the directory never grows without bound."""
        if not self.own_requests:
            return
        old = time.time() - 2 * LOCK_WAIT_S
        for p in self.req_dir.glob("*.safetensors"):
            with contextlib.suppress(FileNotFoundError):
                if str(p) not in self._reading and p.stat().st_mtime < old:
                    vx.remove_request_file(p)

    def close(self) -> None:
        """Commit what is buffered (an interrupted run keeps every answer it collected) and stop."""
        try:
            if self.raw is not None:
                self._flush()
            for f in self._flushes:
                f.result()
        finally:
            self._flushes = []
            self._writer.shutdown(wait=True)
            self._readers.shutdown(wait=True)
            if self.raw is not None:
                self.raw.close()

    # ------------------------------------------------------------------------- end: the manifest

    def header(self) -> dict:
        """The store's format (hs.HEADER_KEYS), as its manifest will say it."""
        storage = hs.describe_storage(self.cfg.storage, len(self.aux_ids), self.H, self.topk)
        return {"target": self.target, "tokenizer": self.tokenizer, "layer_ids": [*self.aux_ids, self.N],
                "aux_layer_ids": self.aux_ids, "last_layer_id": self.N, "hidden_size": self.H, "storage": storage,
                "dtype": storage.get("aux")}

    def finalize(self, raw_path: Path) -> dict:
        """plan.json (the shards as committed) and the store's manifest, as 02 writes them."""
        from safetensors import safe_open

        entries = sorted(hs.committed_shards(self.dir).values(), key=lambda e: e["k"])
        plan = {"version": hs.PLAN_VERSION, "made": CAPTURED,
                "shards": [{"k": e["k"], "ids": e["ids"], "tokens": e["tokens"], "lengths": e["lengths"]}  # 02's keys
                           for e in entries],
                "samples": sum(len(e["ids"]) for e in entries), "tokens": sum(e["tokens"] for e in entries)}
        atomic_write_json(self.dir / hs.PLAN, plan)
        supervised = 0
        for e in entries:
            if not (self.dir / e["shard"]).exists():  # consumed by 04 --follow --consume: the count is unknown
                supervised = None
                break
            with safe_open(str(self.dir / e["shard"]), framework="pt") as f:
                supervised += int(f.get_tensor("loss_mask").sum())
        counts = {"samples": plan["samples"], "tokens": plan["tokens"], "shards": len(entries),
                  "bytes": sum(e["bytes"] for e in entries), "supervised_tokens": supervised,
                  "answers_without_states": sum(1 for r in read_jsonl(raw_path) if r.get("captured") is False),
                  "this_run": dict(self.stats)}
        return write_manifest(
            self.dir, hs.STAGE, config=self.cfg.to_dict(),
            inputs={"raw_responses": describe_file(raw_path, hash_it=False)},
            outputs={"shards": [e["shard"] for e in entries]}, counts=counts, **self.header(), backend="vllm",
            captured=CAPTURED, final_row=FINAL_ROW,
            tokenization={k: getattr(self.cfg, k) for k in ("max_seq_len", "loss_on", "keep_length")},
            layer_convention=("id i = residual stream entering layer i; "
                              f"id {self.N} = last layer output before the final norm"))


def _journal_k(path: Path) -> int:
    return int(path.stem.split("-")[1])


def _rewrite_without(path: Path, ids: set[str]) -> None:
    """`path` without the records of `ids`, streamed to a temp file and renamed (atomic)."""
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}")
    with open(path, "rb") as src, open(tmp, "wb") as dst:
        for line in src:
            try:
                drop = json.loads(line).get("id") in ids
            except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
                drop = False
            if not drop:
                dst.write(line)
        dst.flush()
        os.fsync(dst.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
