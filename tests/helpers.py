"""Helpers shared by several test files (import as `from helpers import ...`)."""

from __future__ import annotations

from pathlib import Path


def make_training_set(directory: Path, tokenizer_dir: Path, n: int = 12, seed: int = 0, *,
                      max_seq_len: int | None = None, id_prefix: str = "s") -> Path:
    """A complete tokenized training set of `n` synthetic reasoning samples (see
    fixtures.synthetic_training_set). Returns `directory`."""
    from eagle3_train.fixtures import synthetic_training_set

    return synthetic_training_set(directory, tokenizer_dir, n=n, seed=seed, id_prefix=id_prefix,
                                  max_seq_len=max_seq_len)


def load_script(name: str):
    """A numbered stage script (e.g. '02_extract_hidden_states') as a module, to call its main()."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "eagle3-train" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"stage_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
