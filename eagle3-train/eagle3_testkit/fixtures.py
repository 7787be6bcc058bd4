"""Cached tiny models for tests, benchmarks and the demo: built once from a seed, reused after.

The cache lives in `$EAGLE3_CACHE` (default `<repo>/.cache/fixtures`); each entry is built into a
temp directory and renamed into place, so concurrent test runs never see half an entry.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from eagle3_train.common.store import TMP_PREFIX, atomic_dir_commit

REPO_ROOT = Path(__file__).resolve().parents[2]
TINY_REASONER = REPO_ROOT / "assets" / "tiny-reasoner"  # the committed trained target
KIMI_TWIN_CORE = REPO_ROOT / "assets" / "kimi-twin-core"  # the trained Kimi twin, live vocab rows only
FIXTURES_VERSION = "3"  # bump when a builder changes, so stale cache entries are not reused


def cache_dir() -> Path:
    return Path(os.environ.get("EAGLE3_CACHE", REPO_ROOT / ".cache" / "fixtures"))


def cached(name: str, build: Callable[[Path], object]) -> Path:
    final = cache_dir() / f"{name}-v{FIXTURES_VERSION}"
    if (final / ".complete").exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f"{TMP_PREFIX}{final.name}.{os.getpid()}"
    build(tmp)
    (tmp / ".complete").write_text("ok\n")
    try:
        atomic_dir_commit(tmp, final)
    except OSError:
        if not (final / ".complete").exists():
            raise
    return final


def tokenizer_dir(template: str = "k25") -> Path:
    from eagle3_testkit.tiny import build_tokenizer

    return cached(f"tokenizer-{template}", lambda d: build_tokenizer(d, template=template))


def random_target_dir(arch: str) -> Path:
    """`llama` or `deepseek_v3`, randomly initialised (seed 0), with the k25 tokenizer."""
    from eagle3_testkit.tiny import build_random_target

    return cached(f"{arch}-random", lambda d: build_random_target(d, arch, tokenizer_dir("k25")))


def tiny_reasoner_dir() -> Path:
    if not (TINY_REASONER / "model.safetensors").exists():
        raise FileNotFoundError(f"{TINY_REASONER} is missing: run `scripts/build_targets.py tiny`")
    return TINY_REASONER


def synthetic_training_set(directory: Path, tokenizer_dir: Path, *, n: int, seed: int, id_prefix: str = "s",
                           id_width: int = 4, max_seq_len: int | None = None) -> Path:
    """A complete tokenized training set (stage `tokenize`) of `n` synthetic reasoning samples
    (ids `<prefix><seed>-<i>`), made the way the pipeline makes one: tokenization.tokenize_sample ->
    dataset.training_record, data.jsonl, then the manifest with the tokenizer's fingerprint.
    For tests and benchmarks that need 01c's output without a server. Returns `directory`."""
    from eagle3_train.common.manifest import describe_tokenizer, write_manifest
    from eagle3_train.common.store import JsonlWriter
    from eagle3_train.common.tokenization import ChatFormat, load_tokenizer, tokenize_sample
    from eagle3_train.tokenize.dataset import DATA, STAGE, summarize, training_record

    from eagle3_testkit.tiny import synthetic_examples

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tok = load_tokenizer(str(tokenizer_dir))  # the stages' loader: the Kimi twin's is remote code
    fmt = ChatFormat.from_tokenizer(tok)
    records = []
    for i, ex in enumerate(synthetic_examples(n, seed)):
        sample = {"id": f"{id_prefix}{seed}-{i:0{id_width}d}",
                  "messages": [{"role": "user", "content": ex["question"]}],
                  "reasoning": ex["reasoning"], "content": ex["answer"], "finish_reason": "stop"}
        records.append(training_record(sample, tokenize_sample(sample, fmt, max_seq_len=max_seq_len)))
    with JsonlWriter(directory / DATA, fsync=False) as w:
        for rec in records:
            w.write(rec)
    write_manifest(directory, STAGE, config={"max_seq_len": max_seq_len, "seed": seed, "n": n},
                   counts=summarize(records), tokenizer=describe_tokenizer(tok, str(tokenizer_dir)),
                   chat_format=fmt.describe())
    return directory


def kimi_tokenizer_dir() -> Path:
    """The twin's tiktoken tokenizer (remote code, Kimi's special ids, vocab 163,840)."""
    from eagle3_testkit.kimi_twin import build_kimi_tokenizer

    return cached("kimi-tokenizer", build_kimi_tokenizer)


def kimi_random_twin_dir() -> Path:
    """An untrained Kimi-K2.5 twin (wrapper + vision tower + DeepSeek-V3 text model), seed 0."""
    from eagle3_testkit.kimi_twin import build_random_twin

    return cached("kimi-twin-random", lambda d: build_random_twin(d, kimi_tokenizer_dir()))


def kimi_twin_dir() -> Path:
    """The trained Kimi-K2.5 twin (full 163,840 vocabulary), assembled from its committed core."""
    from eagle3_testkit.kimi_twin_train import assemble_kimi_twin

    if not (KIMI_TWIN_CORE / "core.json").exists():
        raise FileNotFoundError(f"{KIMI_TWIN_CORE} is missing: run `scripts/build_targets.py kimi-twin`")
    return cached("kimi-twin", lambda d: assemble_kimi_twin(KIMI_TWIN_CORE, d))
