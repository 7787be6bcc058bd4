"""05's run: check the draft, the target and the inputs belong together, then the offline part and
each online arm, each kept once finished (a rerun resumes with the parts still missing), then the
report and the manifest.

Output directory:
  run.json          the settings + input identities of this evaluation (rerun.py: a rerun must match)
  offline.json      the offline result          } each written atomically when finished, kept by
  offline-k<K>.json the offline walk at another K (--k-sweep with --store)
  arms/<arm>.json   one online arm's result     } a rerun (resume = the parts still missing)
  arms/eagle3-k<K>.json  the draft served at another K (--k-sweep)
  report.json, report.md, acceptance.png, vllm-<arm>.log, progress.log
  acceptance_by_position.png  AL by position bucket, when a part counted positions
  manifest.json     written last
With --k-sweep, the K recommended is also written beside the draft, DRAFT/recommended_k.json (the
export's own files are left as they are; 05 does not count that file in the draft's identity).
"""

from __future__ import annotations

import json
from pathlib import Path

from eagle3_train.common.errors import PipelineError
from eagle3_train.common.manifest import describe_file, require_match
from eagle3_train.common.store import atomic_write_json, json_sha256
from eagle3_train.evaluate.config import EvalConfig
from eagle3_train.evaluate.draft import (
    RECOMMENDED,
    describe_draft,
    draft_k,
    draft_method,
    draft_target,
    load_draft,
    load_target_head,
    max_k,
    read_draft_config,
)
from eagle3_train.evaluate.offline import check_store, heldout_ids, offline_eval
from eagle3_train.evaluate.online import run_arm
from eagle3_train.evaluate.report import PLOT, POSITIONS_PLOT, REPORT_JSON, REPORT_MD, build_report, write_report

OFFLINE = "offline.json"
ARMS_DIR = "arms"
# Rewritten by 02 without changing the store: not part of its identity here.
VOLATILE = ("created", "pid", "command", "git_sha")


def run(config: EvalConfig) -> str:
    """Evaluate (or resume); returns report.md's text."""
    from eagle3_train.common import rerun
    from eagle3_train.common.store import DirLock, clean_temp_files

    # Every check before any output: the draft, the target, the store and prompts belong together.
    evaluation = Evaluation(config)
    out = config.output_dir
    with DirLock(out, config.stage):
        # Resume this evaluation, refuse another one, or (--overwrite) move it aside.
        rerun.prepare(config, inputs=evaluation.identity)
        clean_temp_files(out)
        clean_temp_files(out / ARMS_DIR)
        # Each part is kept once finished: a rerun does only the missing ones.
        offline = evaluation.offline(out) if evaluation.store else None
        # --k-sweep with --store: the offline walk at each K too (no server: cheap next to one)
        offline_by_k = {k: offline if k == evaluation.k else evaluation.offline(out, k)
                        for k in evaluation.sweep} if offline else {}
        results = {arm: evaluation.arm(out, arm) for arm in config.arm_list}
        # --k-sweep: the draft served at each K (the eagle3 arm is the one at K)
        sweep = {k: results["eagle3"] if k == evaluation.k else evaluation.arm(out, "eagle3", k)
                 for k in evaluation.sweep}
        from eagle3_train.common.vllm_server import on_cpu

        report = build_report(evaluation.identity, offline, results, sweep, evaluation.method, offline_by_k,
                              cpu=bool(results) and on_cpu(), reasoning_parser=config.reasoning_parser)
        md = write_report(out, report)
        if report.get("k_sweep"):
            evaluation.record_k(out, report["k_sweep"], report["serve"]["command"])
        # Last: from here on the evaluation counts as finished.
        evaluation.write_manifest(out, offline, results)
    return md


class Evaluation:
    """What is evaluated, checked and identified before any output is written."""

    def __init__(self, config: EvalConfig):
        from eagle3_train.common.hidden_store import HiddenStates
        from eagle3_train.common.manifest import describe_target, describe_tokenizer
        from eagle3_train.common.prompts import load_prompts
        from eagle3_train.common.target import load_target_config
        from eagle3_train.common.target_layout import check_cpu_block_draft, check_vocab
        from eagle3_train.common.vllm_server import on_cpu, vllm_cpu_has_amx
        from eagle3_train.common.tokenization import load_tokenizer

        self.config = config
        self.draft_cfg = cfg = read_draft_config(config.draft)
        self.k = config.num_speculative_tokens or draft_k(cfg)
        self.method = draft_method(cfg)
        self.sweep = sorted(set(config.k_sweep))
        top = max_k(cfg)
        over = [k for k in (self.k, *self.sweep) if top is not None and k > top]
        if over:  # vLLM runs 1 + K queries a step: past the trained block the slots were never trained
            raise PipelineError(f"K {over[0]}: the dflash draft {config.draft} was trained at block {top + 1} and "
                                f"drafts at most {top} tokens a step; pass K up to {top} "
                                "(--num-speculative-tokens, --k-sweep), or retrain it with a larger --block-size")
        target = config.target or (Path(draft_target(cfg)) if draft_target(cfg) else None)
        if target is None or not (Path(target) / "config.json").exists():
            raise PipelineError(f"target {target} not found; pass --target (the model the draft was trained for)")
        self.target = target
        self.target_desc = describe_target(load_target_config(str(target)), str(target))
        # As every other stage: the wrapper's config and the remote-code tokenizer (Kimi-K2.5's).
        tokenizer = load_tokenizer(str(target))
        self.tok_desc = describe_tokenizer(tokenizer, str(target))
        check_vocab(self.target_desc["vocab_size"], self.tok_desc["vocab_size"], target)
        layer = cfg.get("transformer_layer_config") or {}
        require_match("target vocab size", self.target_desc["vocab_size"], layer.get("vocab_size"),
                      source=str(config.draft))
        require_match("target hidden size", self.target_desc["hidden_size"],
                      cfg.get("target_hidden_size") or layer.get("hidden_size"), source=str(config.draft))
        self.draft_desc = describe_draft(config.draft)
        self.identity = {"k": self.k, "draft": self.draft_desc, "target": self.target_desc,
                         "tokenizer": self.tok_desc, "offline": None, "online": None}
        self.store, self.aux_index = None, None
        self._offline_models = None  # (draft, target head), loaded once for every K
        if config.store:
            self.store = store = HiddenStates(config.store)
            self.aux_index = check_store(store, cfg, self.target_desc)
            if store.manifest.get("tokenizer"):
                require_match("tokenizer fingerprint", self.tok_desc["fingerprint"],
                              store.manifest["tokenizer"].get("fingerprint"), source=str(config.store))
            ids, self.selection = heldout_ids(store.ids, self.draft_desc)
            self.ids = ids[: config.max_offline_samples]
            self.identity["offline"] = {
                "store": str(config.store.resolve()),
                "store_manifest": json_sha256({k: v for k, v in store.manifest.items() if k not in VOLATILE}),
                "ids_sha256": json_sha256(self.ids), "selection": self.selection,
                "tokens_per_batch": config.offline_tokens_per_batch}
            if config.temperature > 0:  # the sampled walk (only then: a greedy evaluation made before it resumes)
                self.identity["offline"]["walk"] = {"temperature": config.temperature, "top_p": config.top_p,
                                                    "seed": config.seed, "repeats": config.sampled_repeats}
                if not store.has_last and not store.storage.get("topk"):
                    raise PipelineError(f"--temperature {config.temperature}: the store {config.store} keeps neither "
                                        "the last hidden state nor top-k, so the target's probabilities of the "
                                        "proposals are unknown; pass a store 02 wrote with its last layer "
                                        "(or --storage fp8-topk), or --temperature 0")
        if config.prompts:
            prompt_set = load_prompts(str(config.prompts), limit=config.num_prompts, flag="--prompts")
            self.prompts = prompt_set.prompts
            # Acceptance on prompts the draft trained on says nothing of new ones: refused before any
            # server starts (every id in the file, not only the --num-prompts evaluated).
            from eagle3_train.common.lineage import check_heldout

            check_heldout(config.draft, load_prompts(str(config.prompts), flag="--prompts").ids)
            self.max_model_len = config.model_len(longest_prompt(tokenizer, self.prompts))
            self.identity["online"] = {
                "prompts": prompt_set.describe(), "num_prompts": len(self.prompts), "arms": config.arm_list,
                "concurrency": config.concurrency, "sampling": config.sampling, "ngram": config.ngram[:2],
                "max_model_len": self.max_model_len, "reasoning_parser": config.reasoning_parser,
                "server_args": config.server_arg}  # not the URLs: a restarted server may move
            if self.sweep:  # only then: an evaluation made before --k-sweep existed still resumes
                self.identity["online"]["k_sweep"] = self.sweep
            launched = "eagle3" in config.arm_list and ("eagle3" not in config.urls or self.sweep)
            if launched and self.method == "dflash" and on_cpu():
                check_cpu_block_draft(target, self.method, config.server_arg, vllm_cpu_has_amx)

    def offline(self, out: Path, k: int | None = None) -> dict:
        """The offline part at K (offline.json), or at another K of the sweep (offline-k<k>.json),
        from its file when a previous run finished it."""
        config = self.config
        k = k or self.k
        path = out / (OFFLINE if k == self.k else f"offline-k{k}.json")
        offline = load_part(path)
        if offline and "al_all_positions" not in offline:  # counted at every position (before vLLM's walk)
            offline = None
        if offline and (offline.get("by_position") or {}).get("edges") != list(config.position_edges):
            offline = None  # counted before by-position counts, or at other buckets
        if offline and offline.get("walk") == "sampled" and "reach_al" not in offline:
            offline = None  # a sampled walk counted before the reach
        if offline is None:
            print(f"[05] offline: {len(self.ids)} samples ({self.selection}), K={k}", flush=True)
            if self._offline_models is None:
                device, dtype = config.offline_placement()
                print(f"[05] offline on {device} in {dtype}", flush=True)
                self._offline_models = (
                    load_draft(config.draft, self.target, device=device, dtype=dtype),
                    load_target_head(self.target, device=device, dtype=dtype) if self.store.has_last else None)
            model, head = self._offline_models
            offline = offline_eval(model, head, self.store, self.ids, k,
                                   tokens_per_batch=config.offline_tokens_per_batch,
                                   log_path=out / "progress.log", every_s=config.progress_every,
                                   edges=config.position_edges, temperature=config.temperature,
                                   top_p=config.top_p, repeats=config.sampled_repeats, seed=config.seed,
                                   aux_index=self.aux_index)
            offline |= {"selection": self.selection, "heldout": not self.selection.startswith("all")}
            atomic_write_json(path, offline)
        walk = (f", sampled walk at temperature {offline['temperature']}, {offline['repeats']} draws, "
                f"standard error {offline['walk_se']:.4f}" if offline.get("walk") == "sampled" else "")
        print(f"[05] offline AL {offline['acceptance_length']:.3f} over {offline['samples']} samples (K={k}{walk})",
              flush=True)
        return offline

    def arm(self, out: Path, arm: str, k: int | None = None) -> dict:
        """One online arm (the draft's at K = `k` for the sweep: arms/eagle3-k<k>.json, always a
        server of its own: a --url server serves one K), from its file when a previous run finished it."""
        config = self.config
        name = arm if k is None else f"{arm}-k{k}"
        path = out / ARMS_DIR / f"{name}.json"
        res = load_part(path)
        edges = list(config.position_edges)
        if res and arm != "none" and ("by_position" not in res or (res["by_position"] or {}).get("edges", edges)
                                      != edges):
            res = None  # a speculating arm measured before acceptance by position, or at other buckets
        if res is None:
            res = run_arm(arm, target=self.target, draft_dir=config.draft, k=k or self.k, ngram=tuple(config.ngram[:2]),
                          prompts=self.prompts, levels=config.concurrency, sampling=config.sampling,
                          url=config.urls.get(arm) if k is None else None, log_dir=out,
                          server_kwargs={**config.server_kwargs, "max_model_len": self.max_model_len},
                          timeout=config.timeout, every_s=config.progress_every, method=self.method, name=name,
                          wait_s=config.wait_for_server, edges=config.position_edges)
            atomic_write_json(path, res)
        al = res["spec"]["acceptance_length"]
        print(f"[05] {name}: " + ", ".join(f"c={r['concurrency']} {r['output_tok_s']:.1f} tok/s"
                                          for r in res["levels"]) + (f", AL {al:.3f}" if al else ""), flush=True)
        return res

    def record_k(self, out: Path, sweep: dict, serve: str) -> None:
        """The recommended K beside the draft (DRAFT/recommended_k.json, written atomically, with the
        `vllm serve` line at that K); a draft directory we may not write to keeps it in report.json only."""
        rec = {"recommended_k": sweep["recommended_k"], "method": self.method, "serve": serve, "rule": sweep["rule"],
               "concurrency": sweep["concurrency"], "by_k": sweep["by_k"], "target": str(self.target),
               "evaluation": str(Path(out).resolve()), "draft_sha256": self.draft_desc["sha256"]}
        try:
            atomic_write_json(Path(self.config.draft) / RECOMMENDED, rec)
        except OSError as e:
            print(f"[05] note: cannot write {Path(self.config.draft) / RECOMMENDED} ({e.strerror}); the "
                  "recommended K is in report.json", flush=True)
            return
        print(f"[05] recommended K {sweep['recommended_k']} written to {Path(self.config.draft) / RECOMMENDED}",
              flush=True)

    def write_manifest(self, out: Path, offline: dict | None, results: dict) -> None:
        from eagle3_train.common.manifest import write_manifest

        config = self.config
        inputs = {"draft": self.draft_desc, "target": self.target_desc}
        if config.prompts:
            inputs["prompts"] = self.identity["online"]["prompts"]
        if self.store:
            inputs["store"] = {**describe_file(config.store / "manifest.json"),
                               "stage": self.store.manifest.get("stage")}
        write_manifest(out, config.stage, config=config.to_dict(), inputs=inputs,
                       outputs={n: n for n in (REPORT_JSON, REPORT_MD, PLOT, POSITIONS_PLOT) if (out / n).exists()},
                       counts={"offline_samples": offline["samples"] if offline else 0, "arms": len(results)},
                       tokenizer=self.tok_desc, target=self.target_desc)


def longest_prompt(tokenizer, prompts) -> int:
    """Tokens of the longest prompt as the servers see it (the chat template with the generation prompt)."""
    from eagle3_train.common.tokenization import ChatFormat

    fmt = ChatFormat.from_tokenizer(tokenizer, reasoning=False)
    return max(len(fmt.render(p.messages, add_generation_prompt=True)) for p in prompts)


def load_part(path: Path) -> dict | None:
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        return None  # written atomically, so this is foreign damage: redo the part
