"""The tiny pipeline the reliability tests share (Chain): each stage's output made once by the real
stage, in this process, and reused; its fixtures; and inputs made bigger cheaply."""
from __future__ import annotations

from pathlib import Path

import pytest
from helpers import TINY_TRAIN, stage_cli, train_argv

# ----------------------------------------------------------------------------- inputs


def replicate_training_set(src: Path, dst: Path, times: int) -> Path:
    """A bigger tokenized set made cheaply: every record of `src` `times` times under new ids, with
    src's manifest (tokenizer, chat format) carried over, so stages have work worth interrupting."""
    from eagle3_train.common.manifest import read_manifest, write_manifest
    from eagle3_train.common.store import JsonlWriter, read_jsonl
    from eagle3_train.tokenize.dataset import DATA, STAGE

    src, dst = Path(src), Path(dst)
    m = read_manifest(src, STAGE)
    recs = list(read_jsonl(src / DATA))
    with JsonlWriter(dst / DATA, fsync=False) as w:
        for r in range(times):
            for rec in recs:
                w.write({**rec, "id": f"{rec['id']}-r{r}"})
    keep = {k: v for k, v in m.items() if k in ("tokenizer", "chat_format")}
    counts = {k: (v * times if isinstance(v, int) else v) for k, v in m.get("counts", {}).items()}
    write_manifest(dst, STAGE, config={**m.get("config", {}), "replicated": times}, counts=counts, **keep)
    return dst


# ----------------------------------------------------------------------------- a tiny pipeline

HS_ARGS = ["--shard-mb", "0.12", "--batch-tokens", "256", "--storage", "fp8", "--device", "cpu"]
CHAIN_TRAIN = {**TINY_TRAIN, "epochs": 1, "keep_last": 2}  # 04's settings in the chain (train_argv preset)


def argv01b(prompts: Path, out: Path, url: str, *extra) -> list[str]:
    return ["--input", str(prompts), "--output-dir", str(out), "--model", "fake", "--base-url", url, *map(str, extra)]


class Chain:
    """The tiny pipeline's outputs, each made once by the real stage (in this process) and reused:
    prompts -> 01b (gen, against the fake OpenAI server) -> 01c (tokenized) -> 02 (hs) -> 03 (vocab)
    -> 04 (run) -> 05 (eval). Directories under `base`; a step is done when its manifest is there,
    so the test modules of a session share one chain."""

    N_PROMPTS = 30

    def __init__(self, base: Path, tokenizer_dir: Path, target_dir: Path, server_url: str):
        self.base = Path(base)
        self.tokenizer_dir = Path(tokenizer_dir)
        self.target = Path(target_dir)
        self.url = server_url

    def _done(self, name: str) -> bool:
        return (self.base / name / "manifest.json").exists()

    @property
    def prompts(self) -> Path:
        p = self.base / "prompts.jsonl"
        if not p.exists():
            from helpers_generate import write_prompts

            self.base.mkdir(parents=True, exist_ok=True)
            write_prompts(p, [f"question {i}: " + "why " * (i % 7) for i in range(self.N_PROMPTS)])
        return p

    def argv01b(self, out: Path) -> list[str]:
        return argv01b(self.prompts, out, self.url)

    def argv01c(self, out: Path, raw: Path | None = None) -> list[str]:
        return ["--raw-dir", str(raw or self.gen), "--output-dir", str(out), "--tokenizer", str(self.tokenizer_dir)]

    def argv02(self, out: Path, data: Path | None = None) -> list[str]:
        return ["--input", str(data or self.tokenized), "--model", str(self.target), "--output", str(out), *HS_ARGS]

    def argv03(self, out: Path, data: Path | None = None) -> list[str]:
        return ["--data", str(data or self.tokenized), "--target", str(self.target), "--out", str(out),
                "--draft-vocab-size", "100"]

    def argv04(self, out: Path, *extra, hs: Path | None = None, vocab: Path | None = None, **flags) -> list[str]:
        return train_argv(hs or self.hs, vocab or self.vocab, self.target, out, *extra, preset=CHAIN_TRAIN, **flags)

    def argv05(self, out: Path) -> list[str]:
        return ["--draft", str(self.run / "export"), "--store", str(self.hs), "--output-dir", str(out)]

    def _make(self, name: str, script: str, argv) -> Path:
        if not self._done(name):
            rc = stage_cli(script).main(argv(self.base / name))
            assert rc == 0, f"{script} failed while building the chain"
        return self.base / name

    @property
    def gen(self) -> Path:
        return self._make("gen", "01b_generate_synthetic", self.argv01b)

    @property
    def tokenized(self) -> Path:
        return self._make("tokenized", "01c_tokenize", self.argv01c)

    @property
    def hs(self) -> Path:
        return self._make("hs", "02_extract_hidden_states", self.argv02)

    @property
    def vocab(self) -> Path:
        return self._make("vocab", "03_build_vocab_mapping", self.argv03)

    @property
    def run(self) -> Path:
        return self._make("run", "04_train", self.argv04)

    @property
    def eval(self) -> Path:
        return self._make("eval", "05_evaluate", self.argv05)


# ----------------------------------------------------------------------------- shared fixtures
# (import them by name into a test module; module-scoped, so each module gets its own)


@pytest.fixture(scope="module")
def fault_server(tmp_path_factory, k25_tokenizer_dir):
    """The fake OpenAI server (tests/fault_server.py) answering with the k25 tokenizer's real ids."""
    from helpers_generate import FaultServer

    with FaultServer(tmp_path_factory.mktemp("fs"), "--tokenizer", str(k25_tokenizer_dir)) as fs:
        yield fs


@pytest.fixture(scope="module")
def chain(tmp_path_factory, k25_tokenizer_dir, llama_target_dir, fault_server):
    """The tiny pipeline, shared on disk by every module of the session (its answers are a pure
    function of the prompts, whichever module's server makes them)."""
    return Chain(tmp_path_factory.getbasetemp() / "chain", k25_tokenizer_dir, llama_target_dir, fault_server.url)
