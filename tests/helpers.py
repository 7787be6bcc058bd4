"""Helpers shared by several test files (import as `from helpers import ...`)."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "eagle3-train"


def make_training_set(directory: Path, tokenizer_dir: Path, n: int = 12, seed: int = 0, *,
                      max_seq_len: int | None = None, id_prefix: str = "s") -> Path:
    """A complete tokenized training set of `n` synthetic reasoning samples (see
    fixtures.synthetic_training_set). Returns `directory`."""
    from eagle3_testkit.fixtures import synthetic_training_set

    return synthetic_training_set(directory, tokenizer_dir, n=n, seed=seed, id_prefix=id_prefix,
                                  max_seq_len=max_seq_len)


def script_path(name: str) -> Path:
    """A numbered stage script by name ('04_train'), for subprocesses and torchrun."""
    return SCRIPTS / f"{name}.py"


# Each numbered script is a shim over its stage's CLI module; tests call the module's main().
STAGE_PACKAGES = {"00_preflight": "preflight", "00_plan": "plan", "01_split_prompts": "split_prompts", "01a_import_text": "import_text",
                  "01b_generate_synthetic": "generate", "01c_tokenize": "tokenize", "02_extract_hidden_states": "extract", "03_build_vocab_mapping": "vocab",
                  "04_train": "train", "05_evaluate": "evaluate"}


def load_script(name: str):
    """A script under scripts/ ('demo', 'bench/long') imported as it is run: its folder on sys.path."""
    import importlib
    import sys

    folder, _, mod = (REPO / "scripts" / name).as_posix().rpartition("/")
    sys.path.insert(0, folder)
    try:
        return importlib.import_module(mod)
    finally:
        sys.path.remove(folder)


def stage_cli(name: str):
    """The CLI module (eagle3_train.<stage>.cli) of a stage by its script's name ('04_train')."""
    import importlib

    return importlib.import_module(f"eagle3_train.{STAGE_PACKAGES[name]}.cli")


# What the CPU tests of 04 train with: a few tiny steps, a checkpoint every 3, every step logged.
TINY_TRAIN = {"max_tokens_per_batch": 256, "ttt_steps": 3, "val_fraction": 0.25, "save_every": 3,
              "log_every": 1, "epochs": 2, "lr": "3e-3", "quiet": True, "threads": 1}


def train_argv(store: Path, mapping: Path, target: Path, out: Path, *extra, preset: dict = TINY_TRAIN,
               **flags) -> list[str]:
    """04_train's argv: its three inputs and output directory, then `preset` updated by `flags`
    (keyword = flag with `_` for `-`; True: a bare switch; None or False: left out), then `extra`
    as given (raw flags, e.g. `"--max-steps", "2"`)."""
    argv = ["--hidden-states", str(store), "--vocab-mapping", str(mapping), "--target", str(target),
            "--out", str(out)]
    for key, value in {**preset, **flags}.items():
        if value is None or value is False:
            continue
        argv.append("--" + key.replace("_", "-"))
        if value is not True:
            argv.append(str(value))
    return [*argv, *map(str, extra)]


def inputs_argv(inputs: dict, out: Path, *extra, **flags) -> list[str]:
    """train_argv for the dict helpers_train.train_inputs returns."""
    return train_argv(inputs["store"], inputs["map"], inputs["target"], out, *extra, **flags)


class SampleStore:
    """A hidden-state store's read side over SampleStates in memory (offline_eval, validation)."""
    directory = "sample-store"

    def __init__(self, samples):
        self.samples = {s.id: s for s in samples}
        self.ids = list(self.samples)

    def get(self, sid):
        return self.samples[sid]

    def length(self, sid):
        return len(self.samples[sid].input_ids)

    def shard_of(self, sid):
        return "shard-0"
