#!/usr/bin/env python3
"""A stand-in for the capturing vLLM server (01b --capture-hidden-states), for crash sweeps only:
chat answers as tests/fault_server.py makes them (real ids of `--tokenizer`), and for each answer a
per-request file as vLLM's ExampleHiddenStatesConnector writes it: `<dir>/<request id>.safetensors`
with `hidden_states` float32 [T - 1, layers, H] and `token_ids` [T - 1] for the T = prompt + answer
ids, written under a held `.lock` (flock LOCK_EX), named in the response's
`kv_transfer_params.hidden_states_path`. The states are a pure function of the token ids and
positions, so two runs of the same prompts store the same rows bit for bit.

The directory is read from `--dir-file` at every request (one server serves many trial directories,
each 01b's own `.vllm-requests`). The file is written when the answer is finished, after `--delay`
seconds, also for a client that has gone (vLLM saves an aborted request's states too).

    python tests/capture_server.py --port 8123 --tokenizer DIR --dir-file F --layers 4 --hidden-size 64
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import itertools
import json
import os
import sys
from pathlib import Path

import numpy as np
from aiohttp import web

sys.path.insert(0, str(Path(__file__).parent))
from fault_server import Faults  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model", default="fake")
    p.add_argument("--tokenizer", required=True, help="tokenizer dir for the answers' real ids")
    p.add_argument("--dir-file", required=True, help="a file holding the directory to write the states into")
    p.add_argument("--layers", type=int, required=True, help="layer ids the server was asked for (count)")
    p.add_argument("--hidden-size", type=int, required=True)
    p.add_argument("--delay", type=float, default=0.0, help="seconds per answer (default: 0)")
    p.add_argument("--reasoning-words", type=int, default=12)
    return p.parse_args(argv)


def states(ids: list[int], layers: int, hidden: int) -> np.ndarray:
    """[T, layers, H] float32, a function of (token id, position, layer, column) only."""
    t = np.arange(len(ids), dtype=np.float64)[:, None, None]
    tok = np.asarray(ids, dtype=np.float64)[:, None, None]
    lay = np.arange(layers, dtype=np.float64)[None, :, None]
    col = np.arange(hidden, dtype=np.float64)[None, None, :]
    return np.sin(0.37 * tok + 0.11 * t + 1.3 * lay + 0.07 * col).astype(np.float32)


def write_states(path: Path, ids: list[int], layers: int, hidden: int) -> None:
    from safetensors.numpy import save_file

    with open(f"{path}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        save_file({"hidden_states": states(ids, layers, hidden), "token_ids": np.asarray(ids, dtype=np.int64)},
                  str(path))
        fcntl.flock(lock, fcntl.LOCK_UN)


def build_app(args) -> web.Application:
    faults = Faults(argparse.Namespace(heal=True, schedule="", cycle=False, log=None, tokenizer=args.tokenizer,
                                       reasoning_words=args.reasoning_words, model=args.model))
    counter = itertools.count()
    app = web.Application(client_max_size=64 * 1024 * 1024)

    async def models(_request):
        return web.json_response({"object": "list", "data": [{"id": args.model, "object": "model"}]})

    async def health(_request):
        return web.Response(status=200)

    async def chat(request: web.Request):
        body = await request.json()
        if body.get("model") != args.model:
            return web.json_response({"error": {"message": "no such model", "code": 404}}, status=404)
        out = faults.completion(body)
        await asyncio.sleep(args.delay)  # generating; the file comes when the answer is finished
        full = out["prompt_token_ids"] + out["choices"][0]["token_ids"]
        path = Path(Path(args.dir_file).read_text().strip()) / f"req-{os.getpid()}-{next(counter)}.safetensors"
        write_states(path, full[:-1], args.layers, args.hidden_size)  # the last sampled token is never fed
        out["kv_transfer_params"] = {"hidden_states_path": str(path)}
        return web.json_response(out)

    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_post("/v1/chat/completions", chat)
    return app


def main(argv=None) -> int:
    args = parse_args(argv)
    print(f"capture_server listening on http://{args.host}:{args.port}/v1 (pid {os.getpid()})", flush=True)
    web.run_app(build_app(args), host=args.host, port=args.port, print=None, access_log=None, reuse_address=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
