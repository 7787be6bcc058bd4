#!/usr/bin/env python3
"""03: the draft vocabulary. Counts the supervised target tokens of the tokenized training set,
keeps the K most frequent (plus the tokens that end reasoning, turn and sequence), and writes
vocab_mapping.safetensors (d2t, t2d), the token counts, and a coverage report with its curve.

    python eagle3-train/03_build_vocab_mapping.py --data work/tokenized --target MODEL --out work/vocab
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from eagle3_train import vocab
from eagle3_train.dataset import TrainingSet
from eagle3_train.errors import PipelineError, run_main
from eagle3_train.manifest import (describe_file, describe_target, text_config, tokenizer_fingerprint,
                                   write_manifest)
from eagle3_train.progress import Progress
from eagle3_train.store import DirLock, atomic_write_json, clean_temp_files
from eagle3_train.tokenization import ChatFormat, load_tokenizer

# Settings that change the outputs: a complete output made with others is not replaced silently.
OUTPUT_KEYS = ("data", "target", "tokenizer", "draft_vocab_size", "keep_tokens", "no_reasoning",
               "think_start_id", "think_end_id", "end_of_turn_id", "heldout_fraction", "coverage_sizes")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("inputs")
    g.add_argument("--data", required=True, help="tokenized training set directory (data.jsonl + manifest)")
    g.add_argument("--target", required=True,
                   help="target model path or name; its config's vocab_size is the target vocabulary")
    g.add_argument("--tokenizer", default=None,
                   help="tokenizer path or name (default: the target's); must be the one the data was "
                        "tokenized with")
    g = p.add_argument_group("output")
    g.add_argument("--output-dir", "--out", dest="out", required=True, help="output directory")
    g.add_argument("--overwrite", action="store_true",
                   help="replace a complete output built with other settings (old files are moved to "
                        "replaced-<time>/; default: refuse)")
    g = p.add_argument_group("draft vocabulary")
    g.add_argument("--draft-vocab-size", type=int, default=32000,
                   help="K, tokens in the draft vocabulary; clamped to the target vocab (default: 32000)")
    g.add_argument("--keep-tokens", nargs="*", default=[], metavar="TOKEN",
                   help="extra token strings always kept, e.g. tool-call markers (default: none; "
                        "think-start/-end, end-of-turn and EOS are always kept)")
    g.add_argument("--no-reasoning", action="store_true",
                   help="the target does not reason: no think tokens to keep (default: as the data's "
                        "manifest recorded, else it reasons)")
    for flag, what in (("--think-start-id", "<think>"), ("--think-end-id", "</think>"),
                       ("--end-of-turn-id", "end-of-turn")):
        g.add_argument(flag, type=int, default=None,
                       help=f"override the {what} id (default: recorded by tokenize, else looked up by string)")
    g = p.add_argument_group("coverage report")
    g.add_argument("--heldout-fraction", type=float, default=0.1,
                   help="share of samples (fixed by id hash) held out to measure coverage of a "
                        "vocabulary chosen without them (default: 0.1; 0 = none)")
    g.add_argument("--coverage-sizes", type=int, nargs="+", default=None, metavar="K",
                   help="sizes on the coverage curve (default: a log grid over the target vocab, "
                        "4096..65536 and K)")
    g = p.add_argument_group("token counts (token_freq.npy)")
    g.add_argument("--freq-from", default=None, metavar="DIR",
                   help="reuse the counts of another 03 output for this same input, to build another "
                        "size without recounting; refused if they were counted from anything else")
    g.add_argument("--recount", action="store_true",
                   help="count again even if matching counts exist (default: reuse them)")
    return p.parse_args(argv)


def chat_format(args, tok, recorded: dict) -> ChatFormat:
    """The ids to keep, from flags, else what tokenize recorded, else the tokenizer's strings."""
    pick = lambda flag, key: flag if flag is not None else recorded.get(key)  # noqa: E731
    return ChatFormat.from_tokenizer(
        tok, reasoning=not args.no_reasoning and recorded.get("reasoning", True),
        think_start_id=pick(args.think_start_id, "think_start_id"),
        think_end_id=pick(args.think_end_id, "think_end_id"),
        end_of_turn_id=pick(args.end_of_turn_id, "end_of_turn_id"))


def main(argv=None) -> int:
    args = parse_args(argv)
    if not 0 <= args.heldout_fraction < 1:
        raise PipelineError(f"--heldout-fraction must be in [0, 1), not {args.heldout_fraction}")
    if args.draft_vocab_size < 1:
        raise PipelineError(f"--draft-vocab-size must be positive, not {args.draft_vocab_size}")
    out = Path(args.out)
    ts = TrainingSet(Path(args.data))
    with open(ts.path, "rb") as f:
        head = f.read(1 << 16)
    if not head.strip() and len(head) < 1 << 16:
        raise PipelineError(f"{ts.path} is empty: no samples to count")

    target_cfg = vocab.load_target_config(args.target)
    vocab_size = text_config(target_cfg).vocab_size
    tok_name = args.tokenizer or args.target
    tok = load_tokenizer(tok_name)
    theirs = ts.tokenizer
    ours = tokenizer_fingerprint(tok)
    if ours != theirs.get("fingerprint"):
        raise PipelineError(
            f"tokenizer fingerprint mismatch: {ts.directory} was tokenized with "
            f"{theirs.get('name_or_path')} ({theirs.get('fingerprint')}), but this run uses {tok_name} "
            f"({ours}); pass --tokenizer, or retokenize for this target")
    if len(tok) > vocab_size:
        raise PipelineError(f"tokenizer/target mismatch: tokenizer {tok_name} has {len(tok)} tokens but "
                            f"the target {args.target} has vocab_size {vocab_size}")
    fmt = chat_format(args, tok, vocab.recorded_format(ts.manifest))
    required = vocab.required_tokens(fmt, args.keep_tokens)
    k = args.draft_vocab_size
    if k > vocab_size:
        print(f"note: --draft-vocab-size {k} exceeds the target vocabulary; using {vocab_size}")
        k = vocab_size

    local = lambda p: str(Path(p).resolve()) if Path(p).exists() else p  # noqa: E731 (hub names stay)
    config = {**vars(args), "data": local(ts.directory), "target": local(args.target),
              "tokenizer": local(tok_name), "out": str(out.resolve())}
    key_of = lambda data: vocab.freq_key(data, theirs["fingerprint"], vocab_size,  # noqa: E731
                                         args.heldout_fraction)
    with DirLock(out, vocab.STAGE):
        clean_temp_files(out)
        conflict = vocab.config_conflict(out, config, OUTPUT_KEYS)
        if conflict and not args.overwrite:
            raise PipelineError(conflict)
        if conflict and (moved := vocab.move_aside(out)):
            print(f"previous outputs moved to {moved}")
        if not conflict and not args.recount and vocab.already_complete(out, ts.path):
            print(f"{out} is already complete for this input and these settings; nothing to do")
            return 0

        counts, data, source = vocab.counts_for(
            ts.path, out, key_of, vocab_size=vocab_size, heldout_fraction=args.heldout_fraction,
            freq_from=Path(args.freq_from) if args.freq_from else None, recount=args.recount,
            progress=lambda: Progress("03 count", ts.path.stat().st_size, unit="B",
                                      log_path=out / "progress.log"))
        if counts.samples == 0:
            raise PipelineError(f"{ts.path} has no samples to count")
        if counts.total.sum() == 0:
            raise PipelineError(f"{ts.path} has no supervised tokens (every loss_mask is 0)")
        if source != "reused":
            vocab.save_counts(out, counts, key_of(data), data)

        # From here the outputs are rewritten: the directory stops claiming to be complete until
        # the new manifest is written, so a kill in between cannot pair old claims with new files.
        (out / "manifest.json").unlink(missing_ok=True)
        selected = vocab.select_vocab(counts.total, k, [r["id"] for r in required])
        d2t, t2d = vocab.mappings(selected, vocab_size)
        sizes = args.coverage_sizes or vocab.default_sizes(vocab_size, k, len(required))
        report = vocab.coverage_report(counts, k, required, sizes, args.heldout_fraction)
        vocab.save_mapping(out / vocab.MAPPING, d2t, t2d)
        atomic_write_json(out / vocab.COVERAGE_JSON, report)
        vocab.plot_coverage(report, out / vocab.COVERAGE_PNG)
        write_manifest(
            out, vocab.STAGE, config=config,
            inputs={"data": data, "data_manifest": describe_file(ts.directory / "manifest.json"),
                    "token_freq": source},
            outputs={n: describe_file(out / n) for n in (vocab.MAPPING, vocab.COVERAGE_JSON, vocab.FREQ)},
            counts={"samples": counts.samples, "heldout_samples": counts.heldout_samples,
                    "supervised_tokens": int(counts.total.sum()),
                    "distinct_tokens_seen": report["distinct_tokens_seen"]},
            tokenizer=theirs, target=describe_target(target_cfg, args.target),
            target_vocab_size=vocab_size, draft_vocab_size=k, required_tokens=report["required_tokens"],
            coverage=report["coverage"], text_derived=bool(ts.manifest.get("text_derived")))

    cov = report["coverage"]
    held = "n/a (no held-out samples)" if cov["heldout"] is None else f"{100 * cov['heldout']:.2f}%"
    print(f"draft vocab {k} of {vocab_size}: covers {100 * cov['overall']:.2f}% of "
          f"{int(counts.total.sum()):,} supervised tokens; held-out {held}")
    need = ", ".join(f"{float(t):.1%}: {n}" for t, n in report["size_for_coverage"].items() if n)
    print(f"size needed for coverage {need}")
    print(f"wrote {out / vocab.MAPPING}, {out / vocab.COVERAGE_PNG}")
    if ts.manifest.get("text_derived"):
        print(f"note: {ts.directory} is text-derived (ids re-wrapped from text, see its manifest)")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
