"""05_evaluate: acceptance of the trained draft, simulated offline and measured in real vLLM.

    uv run eagle3-train/05_evaluate.py --draft RUN/export --output-dir eval \
        --store hidden/ --prompts heldout_prompts.jsonl --concurrency 1,4,16

Offline (--store): the draft over held-out samples of the 02 store, against the target's greedy
tokens -> AL and per-position acceptance, no server. Online (--prompts): vLLM with the draft
(method eagle3), without speculation and with ngram, same prompts and sampling -> vLLM's own AL,
per-position acceptance and output tokens/s by concurrency. Servers are started here (and stopped)
unless --base-url / --url name running ones. Writes report.json, report.md, acceptance.png.
Rerunning the same command resumes: finished parts (offline, each arm) are kept.
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from eagle3_train import evaluate as ev
from eagle3_train.errors import PipelineError, run_main
from eagle3_train.manifest import describe_file, write_manifest
from eagle3_train.store import DirLock, atomic_write_json, clean_temp_files, json_sha256


def _ints(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("inputs and output")
    g.add_argument("--draft", type=Path, required=True, help="the draft export (04's RUN/export, speculators format)")
    g.add_argument("--target", type=Path, help="target model dir (default: the draft config's verifier path)")
    g.add_argument("--output-dir", "--out", type=Path, required=True, help="where report.json/.md/.png go")
    g.add_argument("--overwrite", action="store_true", help="move an output made with other settings aside and start over")
    g.add_argument("--num-speculative-tokens", type=int, help="K, drafted tokens per step (default: the draft config's)")
    g = p.add_argument_group("offline simulation (no server)")
    g.add_argument("--store", type=Path, help="02's hidden-state store; its held-out samples (per 04's split) are used")
    g.add_argument("--max-offline-samples", type=int, default=200, help="cap on held-out samples (default: 200)")
    g.add_argument("--offline-tokens-per-batch", type=int, default=4096, help="tokens per draft forward (default: 4096)")
    g = p.add_argument_group("online, in vLLM")
    g.add_argument("--prompts", type=Path, help="held-out prompts JSONL (01b's input format); omit to skip online")
    g.add_argument("--num-prompts", type=int, default=32, help="prompts per concurrency level (default: 32)")
    g.add_argument("--concurrency", type=_ints, default=[1, 4, 16], help="levels, comma-separated (default: 1,4,16)")
    g.add_argument("--arms", default="eagle3,none,ngram", help="servers to compare (default: eagle3,none,ngram)")
    g.add_argument("--base-url", help="an eagle3 server already running (same as --url eagle3=URL)")
    g.add_argument("--url", action="append", default=[], metavar="ARM=URL", help="a running server for an arm (repeatable)")
    g.add_argument("--ngram", type=_ints, default=[2, 5], metavar="MIN,MAX", help="ngram prompt lookup min,max (default: 2,5)")
    g.add_argument("--timeout", type=float, default=600, help="per request, seconds (default: 600)")
    g = p.add_argument_group("sampling (the same in every arm)")
    g.add_argument("--max-tokens", type=int, default=512, help="(default: 512)")
    g.add_argument("--temperature", type=float, default=0.0, help="(default: 0, greedy)")
    g.add_argument("--top-p", type=float, default=1.0, help="(default: 1.0)")
    g.add_argument("--seed", type=int, default=0, help="(default: 0)")
    g = p.add_argument_group("servers started here")
    g.add_argument("--max-model-len", type=int, default=2048, help="(default: 2048)")
    g.add_argument("--reasoning-parser", default="kimi_k2", help="'none' to disable (default: kimi_k2)")
    g.add_argument("--startup-timeout", type=float, default=900, help="seconds (default: 900)")
    g.add_argument("--server-arg", action="append", default=[], help="extra vLLM argument (repeatable)")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    from eagle3_train.hidden_store import HiddenStates
    from eagle3_train.manifest import describe_target, describe_tokenizer, require_match
    from eagle3_train.prompts import load_prompts

    if not args.store and not args.prompts:
        raise PipelineError("nothing to evaluate: pass --store (offline) and/or --prompts (online)")
    cfg = ev.read_draft_config(args.draft)
    k = args.num_speculative_tokens or ev.draft_k(cfg)
    target = args.target or (Path(ev.draft_target(cfg)) if ev.draft_target(cfg) else None)
    if target is None or not (Path(target) / "config.json").exists():
        raise PipelineError(f"target {target} not found; pass --target (the model the draft was trained for)")
    from eagle3_train.target_layout import check_vocab, load_config
    from eagle3_train.tokenization import load_tokenizer

    # As every other stage: the wrapper's config and the remote-code tokenizer (Kimi-K2.5's).
    target_desc = describe_target(load_config(target), str(target))
    tok_desc = describe_tokenizer(load_tokenizer(str(target)), str(target))
    check_vocab(target_desc["vocab_size"], tok_desc["vocab_size"], target)
    layer = cfg.get("transformer_layer_config") or {}
    require_match("target vocab size", target_desc["vocab_size"], layer.get("vocab_size"), source=str(args.draft))
    require_match("target hidden size", target_desc["hidden_size"],
                  cfg.get("target_hidden_size") or layer.get("hidden_size"), source=str(args.draft))
    draft_desc = ev.describe_draft(args.draft)
    run = {"k": k, "draft": draft_desc, "target": target_desc, "tokenizer": tok_desc, "offline": None, "online": None}

    store = None
    if args.store:
        store = HiddenStates(args.store)
        ev.check_store(store, cfg, target_desc)
        if store.manifest.get("tokenizer"):
            require_match("tokenizer fingerprint", tok_desc["fingerprint"],
                          store.manifest["tokenizer"].get("fingerprint"), source=str(args.store))
        ids, selection = ev.heldout_ids(store.ids, draft_desc)
        ids = ids[: args.max_offline_samples]
        volatile = ("created", "pid", "command", "git_sha")  # a rewritten manifest is still the same store
        run["offline"] = {"store": str(args.store.resolve()), "store_manifest": json_sha256(
                              {k_: v for k_, v in store.manifest.items() if k_ not in volatile}),
                          "ids_sha256": json_sha256(ids), "selection": selection,
                          "tokens_per_batch": args.offline_tokens_per_batch}
    arms, prompts, urls = [], None, ev.parse_urls(args.url, args.base_url)
    if args.prompts:
        arms = [a.strip() for a in args.arms.split(",") if a.strip()]
        for a in arms:
            ev.spec_config(a, args.draft, k, (1, 1))  # validates the name
        prompt_set = load_prompts(str(args.prompts), limit=args.num_prompts)
        prompts = prompt_set.prompts
        sampling = {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p,
                    "seed": args.seed}
        run["online"] = {"prompts": prompt_set.describe(), "num_prompts": len(prompts), "arms": arms,
                         "concurrency": args.concurrency, "sampling": sampling, "ngram": args.ngram[:2],
                         "max_model_len": args.max_model_len, "reasoning_parser": args.reasoning_parser,
                         "server_args": args.server_arg}  # not the URLs: a restarted server may move

    out = args.output_dir
    with DirLock(out, ev.STAGE):
        if args.overwrite:
            ev.move_aside(out)
        clean_temp_files(out)
        clean_temp_files(out / ev.ARMS_DIR)
        ev.check_run(out, run)
        offline = ev.load_part(out / ev.OFFLINE) if store else None
        if store and offline is None:
            print(f"[05] offline: {len(ids)} samples ({selection}), K={k}", flush=True)
            model = ev.load_draft(args.draft, target)
            head = ev.load_target_head(target) if store.has_last else None
            offline = ev.offline_eval(model, head, store, ids, k, tokens_per_batch=args.offline_tokens_per_batch,
                                      log_path=out / "progress.log")
            offline |= {"selection": selection, "heldout": not selection.startswith("all")}
            atomic_write_json(out / ev.OFFLINE, offline)
        if offline:
            print(f"[05] offline AL {offline['acceptance_length']:.3f} over {offline['samples']} samples", flush=True)
        results = {}
        server_kwargs = {"max_model_len": args.max_model_len, "startup_timeout": args.startup_timeout,
                         "reasoning_parser": None if args.reasoning_parser == "none" else args.reasoning_parser,
                         "extra_args": args.server_arg}
        for arm in arms:
            path = out / ev.ARMS_DIR / f"{arm}.json"
            res = ev.load_part(path)
            if res is None:
                res = ev.run_arm(arm, target=target, draft_dir=args.draft, k=k, ngram=tuple(args.ngram[:2]),
                                 prompts=prompts, levels=args.concurrency, sampling=run["online"]["sampling"],
                                 url=urls.get(arm), server_kwargs=server_kwargs, log_dir=out, timeout=args.timeout)
                atomic_write_json(path, res)
            results[arm] = res
            al = res["spec"]["acceptance_length"]
            print(f"[05] {arm}: " + ", ".join(f"c={r['concurrency']} {r['output_tok_s']:.1f} tok/s"
                                              for r in res["levels"])
                  + (f", AL {al:.3f}" if al else ""), flush=True)
        rep = ev.build_report(run, offline, results)
        md = ev.write_report(out, rep)
        inputs = {"draft": draft_desc, "target": target_desc}
        if args.prompts:
            inputs["prompts"] = run["online"]["prompts"]
        if store:
            inputs["store"] = {**describe_file(args.store / "manifest.json"), "stage": store.manifest.get("stage")}
        write_manifest(out, ev.STAGE, config={k_: str(v) if isinstance(v, Path) else v for k_, v in vars(args).items()},
                       inputs=inputs, outputs={n: n for n in (ev.REPORT_JSON, ev.REPORT_MD, ev.PLOT)},
                       counts={"offline_samples": offline["samples"] if offline else 0, "arms": len(results)},
                       tokenizer=tok_desc, target=target_desc)
    print(md, end="")
    return 0


def _interrupt(signum, frame):
    raise KeyboardInterrupt  # SIGTERM stops like Ctrl-C: the vLLM servers started here are stopped


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _interrupt)
    sys.exit(run_main(main))
