"""Helpers shared by several test files (import as `from helpers import ...`)."""

from __future__ import annotations

from pathlib import Path


def make_training_set(directory: Path, tokenizer_dir: Path, n: int = 12, seed: int = 0, *,
                      max_seq_len: int | None = None, id_prefix: str = "s") -> Path:
    """A complete tokenized training set (stage `tokenize`) of `n` synthetic reasoning samples,
    made the way the pipeline makes one: tokenization.tokenize_sample -> dataset.training_record,
    data.jsonl, then the manifest with the tokenizer's fingerprint. Returns `directory`."""
    from transformers import AutoTokenizer

    from eagle3_train.dataset import DATA, STAGE, summarize, training_record
    from eagle3_train.manifest import describe_tokenizer, write_manifest
    from eagle3_train.store import JsonlWriter
    from eagle3_train.tiny import synthetic_examples
    from eagle3_train.tokenization import ChatFormat, tokenize_sample

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    fmt = ChatFormat.from_tokenizer(tok)
    records = []
    for i, ex in enumerate(synthetic_examples(n, seed)):
        sample = {"id": f"{id_prefix}{seed}-{i:04d}", "messages": [{"role": "user", "content": ex["question"]}],
                  "reasoning": ex["reasoning"], "content": ex["answer"], "finish_reason": "stop"}
        records.append(training_record(sample, tokenize_sample(sample, fmt, max_seq_len=max_seq_len)))
    with JsonlWriter(directory / DATA, fsync=False) as w:
        for rec in records:
            w.write(rec)
    write_manifest(directory, STAGE, config={"max_seq_len": max_seq_len, "seed": seed, "n": n},
                   counts=summarize(records), tokenizer=describe_tokenizer(tok, str(tokenizer_dir)),
                   chat_format=fmt.describe())
    return directory


def load_script(name: str):
    """A numbered stage script (e.g. '02_extract_hidden_states') as a module, to call its main()."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "eagle3-train" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"stage_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
