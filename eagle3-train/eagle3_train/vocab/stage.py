"""03, the stage: the tokenized set -> the draft vocabulary (vocab_mapping.safetensors), its token
counts and its coverage report, for a VocabConfig.

Flow: check the input against the target (tokenizer fingerprint, vocabulary size) before writing
anything; in the output's lock, apply the rerun policy (rerun.py: another K, another target...
is refused unless --overwrite); a complete output for exactly this input is a no-op; else count
(or reuse matching counts), select, and write mapping, report, plot and, last, the manifest.
"""

from __future__ import annotations

from pathlib import Path

from eagle3_train.common import rerun
from eagle3_train.common.config import VOCAB
from eagle3_train.common.errors import PipelineError
from eagle3_train.common.manifest import (
    MANIFEST,
    describe_file,
    describe_target,
    read_manifest,
    text_config,
    tokenizer_fingerprint,
    write_manifest,
)
from eagle3_train.common.progress import Progress
from eagle3_train.common.store import DirLock, atomic_write_json, clean_temp_files
from eagle3_train.common.target import load_target_config
from eagle3_train.common.tokenization import ChatFormat, load_tokenizer
from eagle3_train.tokenize.dataset import TrainingSet
from eagle3_train.vocab import coverage
from eagle3_train.vocab import mapping as vocab
from eagle3_train.vocab.counts import counts_for, freq_key, save_counts


def chat_format(cfg, tok, recorded: dict) -> ChatFormat:
    """The ids to keep, from flags, else what tokenize recorded, else the tokenizer's strings."""
    pick = lambda flag, key: flag if flag is not None else recorded.get(key)  # noqa: E731
    return ChatFormat.from_tokenizer(
        tok, reasoning=not cfg.no_reasoning and recorded.get("reasoning", True),
        think_start_id=pick(cfg.think_start_id, "think_start_id"),
        think_end_id=pick(cfg.think_end_id, "think_end_id"),
        end_of_turn_id=pick(cfg.end_of_turn_id, "end_of_turn_id"))


def already_complete(out_dir: Path, data_path: Path) -> bool:
    """The complete output in out_dir was built from exactly this input and its files are intact
    (the settings were compared by the rerun policy): a rerun has nothing to do."""
    try:
        old = read_manifest(out_dir, VOCAB)
    except PipelineError:
        return False
    recorded = old.get("inputs", {}).get("data", {})
    if recorded.get("size") != Path(data_path).stat().st_size:
        return False
    for name, desc in old.get("outputs", {}).items():
        p = Path(out_dir) / name
        if not p.exists() or describe_file(p).get("sha256") != desc.get("sha256"):
            return False
    return describe_file(data_path)["sha256"] == recorded.get("sha256")


def run(cfg) -> int:
    """The whole stage; returns the exit code."""
    out = cfg.output_dir
    ts = TrainingSet(Path(cfg.data))
    with open(ts.path, "rb") as f:
        head = f.read(1 << 16)
    if not head.strip() and len(head) < 1 << 16:
        raise PipelineError(f"{ts.path} is empty: no samples to count")

    target_cfg = load_target_config(cfg.target)
    vocab_size = text_config(target_cfg).vocab_size
    k = cfg.draft_size(vocab_size)  # the flags' ids and sizes against the target's vocabulary, first
    tok = load_tokenizer(cfg.tokenizer)
    theirs = ts.tokenizer
    ours = tokenizer_fingerprint(tok)
    if ours != theirs.get("fingerprint"):
        raise PipelineError(
            f"tokenizer fingerprint mismatch: {ts.directory} was tokenized with "
            f"{theirs.get('name_or_path')} ({theirs.get('fingerprint')}), but this run uses {cfg.tokenizer} "
            f"({ours}); pass --tokenizer, or retokenize for this target")
    if len(tok) > vocab_size:
        raise PipelineError(f"tokenizer/target mismatch: tokenizer {cfg.tokenizer} has {len(tok)} tokens but "
                            f"the target {cfg.target} has vocab_size {vocab_size}")
    required = vocab.required_tokens(chat_format(cfg, tok, vocab.recorded_format(ts.manifest)), cfg.keep_tokens)

    key_of = lambda data: freq_key(data, theirs["fingerprint"], vocab_size, cfg.heldout_fraction)  # noqa: E731
    with DirLock(out, VOCAB):
        clean_temp_files(out)
        # No input hashes in the record: 03 recounts whenever its input's bytes change (the
        # frequency file's key), so only the settings decide whether this is the same run.
        rerun.prepare(cfg)
        if not cfg.overwrite and not cfg.recount and already_complete(out, ts.path):
            print(f"{out} is already complete for this input and these settings; nothing to do")
            return 0

        counts, data, source = counts_for(
            ts, out, key_of, vocab_size=vocab_size, heldout_fraction=cfg.heldout_fraction,
            freq_from=cfg.freq_from, recount=cfg.recount,
            progress=lambda: Progress("03 count", ts.path.stat().st_size, unit="B", log_path=out / "progress.log",
                                      every_s=cfg.progress_every))
        if counts.samples == 0:
            raise PipelineError(f"{ts.path} has no samples to count")
        if counts.total.sum() == 0:
            raise PipelineError(f"{ts.path} has no supervised tokens (every loss_mask is 0)")
        if source != "reused":
            save_counts(out, counts, key_of(data), data)

        # From here the outputs are rewritten: the directory stops claiming to be complete until
        # the new manifest is written, so a kill in between cannot pair old claims with new files.
        (out / MANIFEST).unlink(missing_ok=True)
        selected = vocab.select_vocab(counts.total, k, [r["id"] for r in required])
        d2t, t2d = vocab.mappings(selected, vocab_size)
        sizes = cfg.coverage_sizes or coverage.default_sizes(vocab_size, k, len(required))
        report = coverage.coverage_report(counts, k, required, sizes, cfg.heldout_fraction)
        vocab.save_mapping(out / vocab.MAPPING, d2t, t2d)
        atomic_write_json(out / vocab.COVERAGE_JSON, report)
        coverage.plot_coverage(report, out / vocab.COVERAGE_PNG)
        write_manifest(
            out, VOCAB, config=cfg.to_dict(),
            inputs={"data": data, "data_manifest": describe_file(ts.directory / MANIFEST), "token_freq": source},
            outputs={n: describe_file(out / n) for n in (vocab.MAPPING, vocab.COVERAGE_JSON, vocab.FREQ)},
            counts={"samples": counts.samples, "heldout_samples": counts.heldout_samples,
                    "supervised_tokens": int(counts.total.sum()),
                    "distinct_tokens_seen": report["distinct_tokens_seen"]},
            tokenizer=theirs, target=describe_target(target_cfg, cfg.target),
            target_vocab_size=vocab_size, draft_vocab_size=k, required_tokens=report["required_tokens"],
            coverage=report["coverage"], text_derived=bool(ts.manifest.get("text_derived")))
    print(summary(report))
    print(f"wrote {out / vocab.MAPPING}, {out / vocab.COVERAGE_PNG}")
    if ts.manifest.get("text_derived"):
        print(f"note: {ts.directory} is text-derived (ids re-wrapped from text, see its manifest)")
    return 0


def summary(report: dict) -> str:
    cov, st = report["coverage"], report["supervised_tokens"]
    held = "n/a (no held-out samples)" if cov["heldout"] is None else f"{100 * cov['heldout']:.2f}%"
    need = ", ".join(f"{float(t):.1%}: {n}" for t, n in report["size_for_coverage"].items() if n)
    return (f"draft vocab {report['draft_vocab_size']} of {report['target_vocab_size']}: covers "
            f"{100 * cov['overall']:.2f}% of {st['total']:,} supervised tokens; held-out {held}\n"
            f"size needed for coverage {need}")
