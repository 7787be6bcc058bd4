"""Typed stage configs, and every stage's id.

Each stage has one config dataclass (a subclass of `StageConfig`): built once from the parsed
arguments, validated in one place (`validate()`, run by `__post_init__`, raising a one-line
PipelineError), a help text per field, the fields that may change on a resume marked
`resume=True`, and saved in the manifest (`to_dict()`). `--output-dir` is `output_dir` in every
stage. The rerun policy (rerun.py) compares `identity()`, the fields that are not resumable.

Example::

    @dataclass(kw_only=True)
    class CountConfig(StageConfig):
        stage: ClassVar[str] = VOCAB
        outputs: ClassVar[tuple[str, ...] | None] = ("vocab_mapping.safetensors", MANIFEST)

        data: str = setting(help="tokenized training set directory")
        draft_vocab_size: int = setting(32000, help="tokens in the draft vocabulary")
        progress_every: float = setting(30.0, help="seconds between lines in progress.log", resume=True)

        def validate(self):
            if self.draft_vocab_size < 1:
                raise PipelineError(f"--draft-vocab-size must be positive, not {self.draft_vocab_size}")

    # the script: flag, type and group stay in argparse; default and help come from the field
    g.add_argument("--draft-vocab-size", type=int, **CountConfig.arg("draft_vocab_size"))
    cfg = CountConfig.from_args(parser.parse_args(argv))   # validated here, once
    cfg.to_dict()     # the manifest's "config"
    cfg.identity()    # what a rerun must match to resume
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import MISSING, dataclass
from pathlib import Path
from typing import Any, ClassVar

from eagle3_train.common.errors import PipelineError

# ----------------------------------------------------------------------------- stage ids
# What a stage writes in its manifest's `stage` and what the next stage checks: the script's name.
SPLIT_PROMPTS = "01_split_prompts"  # the prompt source -> train.jsonl + heldout.jsonl
IMPORT_TEXT = "01a_import_text"  # writes a GENERATE-format directory (its manifest says GENERATE)
GENERATE = "01b_generate_synthetic"
TOKENIZE = "01c_tokenize"
EXTRACT = "02_extract_hidden_states"
VOCAB = "03_build_vocab_mapping"
TRAIN = "04_train"
EVALUATE = "05_evaluate"
STAGES = (SPLIT_PROMPTS, IMPORT_TEXT, GENERATE, TOKENIZE, EXTRACT, VOCAB, TRAIN, EVALUATE)
# Ids written before they were the script's name; manifest.read_manifest still accepts them.
LEGACY_IDS = {"01b": GENERATE, "tokenize": TOKENIZE}


# ----------------------------------------------------------------------------- fields

def setting(default: Any = MISSING, *, help: str, resume: bool = False, secret: bool = False,  # noqa: A002
            default_factory: Any = MISSING) -> Any:
    """A config field. `help` is its docstring and the flag's help text; `resume=True`: it may
    change between a run and its resume (how, not what, is computed); `secret=True`: redacted in
    to_dict() (an API key)."""
    meta = {"help": help, "resume": resume, "secret": secret}
    if default_factory is not MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _plain(value):
    """JSON-ready: paths as strings, tuples as lists."""
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


class Settings:
    """What every config dataclass can say about its fields (mixed into StageConfig, and into
    groups of settings that several stages share)."""

    @classmethod
    def field_of(cls, name: str) -> dataclasses.Field:
        for f in dataclasses.fields(cls):
            if f.name == name:
                return f
        raise KeyError(f"{cls.__name__} has no field {name!r}")

    @classmethod
    def default(cls, name: str):
        f = cls.field_of(name)
        if f.default is not MISSING:
            return f.default
        if f.default_factory is not MISSING:
            return f.default_factory()
        return MISSING

    @classmethod
    def help(cls, name: str) -> str:
        """The field's help, with its default appended unless the text already says it (a None or
        False default is a sentinel the text must explain)."""
        text = cls.field_of(name).metadata["help"]
        default = cls.default(name)
        if "(default" in text or default is MISSING or default is False or default is None:
            return text
        return f"{text} (default: {default})"

    @classmethod
    def arg(cls, name: str, **extra) -> dict:
        """add_argument keywords for a field: dest, default and help from the field."""
        kw = {"dest": name, "help": cls.help(name)}
        default = cls.default(name)
        if default is MISSING:
            kw["required"] = True
        else:
            kw["default"] = default
        return {**kw, **extra}

    @classmethod
    def from_args(cls, args: argparse.Namespace, **overrides):
        """The config from parsed arguments (argparse `dest` = field name). An argument the
        config does not know is a bug in the script, so it raises."""
        given = {**vars(args), **overrides}
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(given) - names)
        if unknown:
            raise TypeError(f"{cls.__name__} has no field for argument(s) {', '.join(unknown)}")
        return cls(**given)

    @classmethod
    def resumable(cls) -> frozenset[str]:
        return frozenset(f.name for f in dataclasses.fields(cls) if f.metadata.get("resume"))

    def to_dict(self) -> dict:
        """Every setting, JSON-ready, secrets redacted: the manifest's `config`."""
        out = {}
        for f in dataclasses.fields(self):
            value = _plain(getattr(self, f.name))
            if f.metadata.get("secret") and value not in (None, "", "EMPTY"):
                value = "<redacted>"
            out[f.name] = value
        return out

    @classmethod
    def identity_defaults(cls) -> dict:
        """The defaults of the identity's fields, JSON-ready (what a record made before a field
        existed is taken to have held)."""
        skip = cls.resumable()
        return {f.name: _plain(d) for f in dataclasses.fields(cls)
                if f.name not in skip and (d := cls.default(f.name)) is not MISSING}

    def identity(self) -> dict:
        """The settings a resume must match: every field not marked resume=True."""
        skip = self.resumable()
        return {k: v for k, v in self.to_dict().items() if k not in skip}

    def given(self, *names: str) -> list[str]:
        """The flags among `names` (field names) set to other than their defaults, as `--flag`: what
        validate() names when they only matter with another flag."""
        return [f"--{n.replace('_', '-')}" for n in names if getattr(self, n) != self.default(n)]


@dataclass(kw_only=True)
class StageConfig(Settings):
    """Base of every stage's config. Subclasses set `stage` (an id above) and `outputs` (what
    `--overwrite` moves aside besides run.json and the manifest; None = everything in the
    directory), add their fields with `setting(...)`, and check them in `validate()`."""

    stage: ClassVar[str] = ""
    outputs: ClassVar[tuple[str, ...] | None] = None
    # Files that, present without run.json, mean the directory holds output this policy did not
    # record (another tool's, or a hand-made one): refused rather than mixed into.
    claims: ClassVar[tuple[str, ...]] = ()

    output_dir: Path = setting(help="output directory", resume=True)

    def __post_init__(self):
        if self.output_dir is not None:
            self.output_dir = Path(self.output_dir)
        self.validate()

    def validate(self) -> None:
        """Raise PipelineError (one line naming the flag and the value) for a bad setting."""


def join_dash_values(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    """`--layers -1,2,3` -> `--layers=-1,2,3` for the given flags: argparse takes a value that starts
    with '-' and a digit for an option and says only "expected one argument"; joined, the value
    reaches the config's own check and its one-line message."""
    out, i = [], 0
    argv = list(argv)
    while i < len(argv):
        arg = argv[i]
        if arg in flags and i + 1 < len(argv) and argv[i + 1][:1] == "-" and argv[i + 1][1:2].isdigit():
            out.append(f"{arg}={argv[i + 1]}")
            i += 2
            continue
        out.append(arg)
        i += 1
    return out


def require(ok: bool, message: str) -> None:
    """validate()'s one-liner: raise PipelineError(message) unless ok."""
    if not ok:
        raise PipelineError(message)
