"""The bad-input catalogue, across the stages that meet each input: every case ends in exactly one
`error: ...` line naming what is wrong, exit 2 (no traceback), and nothing already written is lost
or changed (inputs and earlier outputs hashed before and after).

Stages run in this process through errors.run_main (what `python eagle3-train/NN_*.py` runs;
reliability.run_inprocess), so an exception that escapes as a traceback fails the test the same
way."""

from __future__ import annotations

import http.server
import json
import shutil
import threading
from pathlib import Path

import pytest
from helpers_generate import FaultServer, write_prompts
from reliability import (  # noqa: F401
    Chain,
    Result,
    assert_one_error_line,
    assert_unchanged,
    chain,
    fault_server,
    run_inprocess,
    snapshot,
)


@pytest.fixture(scope="module")
def raw_dir(chain):
    """A complete 01b output (30 answers with the k25 tokenizer's real ids)."""
    return chain.gen


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".lock", "progress.log"))
    return dst


def edit_jsonl(path: Path, fn) -> None:
    """Rewrite a JSONL file record by record: fn(index, record) -> a record, a raw line, or None."""
    lines = []
    for i, line in enumerate(path.read_text().splitlines()):
        new = fn(i, json.loads(line))
        if new is not None:
            lines.append(new if isinstance(new, str) else json.dumps(new))
    path.write_text("\n".join(lines) + "\n")


def refused(res: Result, inputs: dict[Path, dict], out: Path | None, *needles: str) -> str:
    """One error line naming the needles, exit 2, the inputs untouched, no complete output."""
    line = assert_one_error_line(res, *needles)
    for d, before in inputs.items():
        assert_unchanged(before, d, allow_new=lambda rel: False)
    if out is not None:
        assert not (out / "manifest.json").exists(), "a refused run left an output claiming completeness"
    return line


# ----------------------------------------------------------------------------- stage inputs

def tok_input(chain: Chain, tmp_path: Path, fn) -> Path:
    d = copy(chain.tokenized, tmp_path / "tokenized")
    edit_jsonl(d / "data.jsonl", fn)
    return d


def run_02_03(stage: str, chain: Chain, data: Path, tmp_path: Path, capfd) -> tuple[Result, Path]:
    out = tmp_path / f"out{stage}"
    if stage == "02":
        return run_inprocess("02_extract_hidden_states", chain.argv02(out, data), capfd), out
    return run_inprocess("03_build_vocab_mapping", chain.argv03(out, data), capfd), out


@pytest.mark.parametrize("stage", ["02", "03"])
def test_malformed_jsonl_line_in_training_data(stage, chain, tmp_path, capfd):
    data = tok_input(chain, tmp_path, lambda i, r: '{"id": "s5-x", "input_ids": [1, 2' if i == 4 else r)
    before = snapshot(data)
    res, out = run_02_03(stage, chain, data, tmp_path, capfd)
    refused(res, {data: before}, out, "data.jsonl:5", "malformed")


@pytest.mark.parametrize("stage", ["02", "03"])
def test_missing_field_in_training_data(stage, chain, tmp_path, capfd):
    data = tok_input(chain, tmp_path, lambda i, r: {k: v for k, v in r.items() if k != "loss_mask"} if i == 3 else r)
    before = snapshot(data)
    res, out = run_02_03(stage, chain, data, tmp_path, capfd)
    refused(res, {data: before}, out, "loss_mask")


@pytest.mark.parametrize("stage", ["02", "03"])
def test_token_ids_from_another_tokenizer(stage, chain, tmp_path, capfd):
    """A record whose ids were made with a larger vocabulary (id 163607 = Kimi's </think>)."""
    data = tok_input(chain, tmp_path, lambda i, r: {**r, "input_ids": [*r["input_ids"][:-1], 163607]} if i == 2 else r)
    before = snapshot(data)
    res, out = run_02_03(stage, chain, data, tmp_path, capfd)
    refused(res, {data: before}, out, "163607", "vocab")  # the id and the vocabulary it is outside of


# ----------------------------------------------------------------------------- 01b inputs and servers

def run01b(prompts: Path, out: Path, url: str, capfd, *extra) -> Result:
    return run_inprocess("01b_generate_synthetic", ["--input", prompts, "--output-dir", out, "--model", "fake",
                                                   "--base-url", url, "--max-retries", "0", *extra], capfd)


@pytest.mark.parametrize("row, needles", [
    ('{"id": "b", "messages": [{"role": "user", "con', ("p.jsonl:2", "malformed")),   # malformed line
    ('{"id": "b", "text": "no conversation field"}', ("p.jsonl:2", "messages")),      # missing fields
    ('{"id": "b", "messages": [{"role": "user", "content": "  "}]}', ("p.jsonl:2", "empty prompt")),
    ('{"id": "b", "prompt": ""}', ("p.jsonl:2", "empty prompt")),
], ids=["malformed", "missing-fields", "empty-message", "empty-prompt-field"])
def test_01b_bad_prompt_rows(row, needles, tmp_path, fault_server, capfd):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "messages": [{"role": "user", "content": "fine"}]}\n' + row + "\n"
                       '{"id": "c", "prompt": "also fine"}\n')
    before = snapshot(tmp_path)
    res = run01b(prompts, tmp_path / "gen", fault_server.url, capfd)
    refused(res, {}, tmp_path / "gen", *needles)
    assert_unchanged(before, tmp_path, allow_new=lambda rel: rel.startswith("gen/"))
    assert not (tmp_path / "gen" / "raw_responses.jsonl").exists() or \
        not (tmp_path / "gen" / "raw_responses.jsonl").read_bytes(), "requests were made before the input was checked"


def test_01b_same_id_with_another_prompt(tmp_path, fault_server, capfd):
    """Two rows with one id: the same prompt again is asked once (as before); another prompt under
    that id is refused naming the id and both rows (01a's rule, prompts.repeated_id), before any
    request and without touching the finished output of the earlier run."""
    prompts, out = tmp_path / "p.jsonl", tmp_path / "gen"
    a, b = '{"id": "a", "prompt": "first"}', '{"id": "b", "prompt": "other"}'
    prompts.write_text(f"{a}\n{b}\n{a}\n")
    res = run01b(prompts, out, fault_server.url, capfd)
    assert res.rc == 0, res.stderr
    assert [json.loads(x)["id"] for x in (out / "raw_responses.jsonl").read_text().splitlines()] == ["a", "b"]
    before, asked = snapshot(out), len(fault_server.requests())
    prompts.write_text(f'{a}\n{b}\n{{"id": "a", "prompt": "second"}}\n')
    res = run01b(prompts, out, fault_server.url, capfd)
    assert_one_error_line(res, "'a' appears twice", "different", "p.jsonl:1", "p.jsonl:3")
    assert_unchanged(before, out, allow_new=lambda rel: False)
    assert len(fault_server.requests()) == asked


@pytest.mark.parametrize("flag, value, needle", [
    ("--max-tokens", "0", "at least 1"), ("--temperature", "-1", "not be negative"),
    ("--top-p", "0", "(0, 1]"), ("--top-p", "1.5", "(0, 1]"), ("--concurrency", "0", "positive"),
    ("--timeout", "0", "positive"), ("--connect-timeout", "0", "positive"), ("--max-retries", "-1", "negative"),
    ("--abort-after", "-1", "negative"), ("--backoff-base", "-2", "negative"), ("--limit", "0", ">= 1"),
    ("--concurrency", "many", "auto"), ("--max-concurrency", "0", "positive"), ("--concurrency-every", "0", "positive"),
])
def test_01b_nonsense_numbers_are_refused_before_any_request(flag, value, needle, tmp_path, fault_server, capfd):
    prompts = write_prompts(tmp_path / "p.jsonl", ["a", "b"])
    asked = len(fault_server.requests())
    res = run01b(prompts, tmp_path / "gen", fault_server.url, capfd, flag, value)
    assert_one_error_line(res, f"{flag} must", needle, value)
    assert len(fault_server.requests()) == asked and not (tmp_path / "gen").exists()


@pytest.mark.parametrize("abort_after", ["64", "2"], ids=["all-sent", "streak-abort"])
def test_01b_every_request_rejected_says_why_and_writes_no_manifest(abort_after, tmp_path, fault_server, capfd):
    """Requests the server rejects (400) fail the same way on every rerun: the line names the
    cause instead of advising a rerun, exit 2, and an output with no answer is not complete."""
    prompts = write_prompts(tmp_path / "p.jsonl", [f"[[fault:400]] q{i}" for i in range(4)])
    out = tmp_path / "gen"
    res = run01b(prompts, out, fault_server.url, capfd, "--abort-after", abort_after, "--concurrency", "1")
    line = refused(res, {}, out, "rejected as a bad request", "400", "a rerun would fail the same way")
    assert "rerun the same command" not in res.stderr and "retry them" not in res.stderr, res.stderr
    assert line.startswith("error: every request" if abort_after == "64" else "error: 2 requests in a row")
    errs = [json.loads(x) for x in (out / "errors.jsonl").read_text().splitlines()]
    assert {e["error_type"] for e in errs} == {"http_400"} and not any(e["retryable"] for e in errs)


def test_01b_some_requests_rejected_is_exit_1_without_rerun_advice(tmp_path, fault_server, capfd):
    prompts = write_prompts(tmp_path / "p.jsonl", ["fine 1", "[[fault:400]] bad", "fine 2"])
    out = tmp_path / "gen"
    res = run01b(prompts, out, fault_server.url, capfd)
    assert res.rc == 1 and not res.error_lines(), res.stderr
    assert "1 ids were rejected as a bad request (400" in res.stderr and "a rerun would fail the same way" in res.stderr
    assert "rerun the same command" not in res.stderr
    man = json.loads((out / "manifest.json").read_text())
    assert (man["counts"]["answered"], man["counts"]["failed"]) == (2, 1)


def test_01b_base_url_without_v1_names_the_404(tmp_path, fault_server, capfd):
    prompts = write_prompts(tmp_path / "p.jsonl", ["a"])
    url = fault_server.url.removesuffix("/v1")
    res = run01b(prompts, tmp_path / "gen", url, capfd)
    line = refused(res, {}, tmp_path / "gen", "answered 404", f"{url}/models", "must end in /v1")
    assert "not reachable" not in line


@pytest.mark.parametrize("wait, needle", [("0", "no endpoint is reachable"),
                                          ("1", "not ready after 1 s (--wait-for-server)")])
def test_01b_server_unreachable(wait, needle, tmp_path, capfd):
    from eagle3_train.common.vllm_server import free_port

    prompts = write_prompts(tmp_path / "p.jsonl", ["a", "b"])
    url = f"http://127.0.0.1:{free_port()}/v1"
    res = run01b(prompts, tmp_path / "gen", url, capfd, "--connect-timeout", "2", "--wait-for-server", wait)
    refused(res, {}, tmp_path / "gen", url, needle)


def test_05_server_unreachable(chain, tmp_path, capfd):
    from eagle3_train.common.vllm_server import free_port

    prompts = write_prompts(tmp_path / "p.jsonl", ["a"], ids=["unseen"])  # not a prompt the draft trained on
    url = f"http://127.0.0.1:{free_port()}/v1"
    res = run_inprocess("05_evaluate", ["--draft", chain.run / "export", "--prompts", prompts, "--arms", "eagle3",
                                        "--base-url", url, "--output-dir", tmp_path / "ev", "--num-prompts", "1",
                                        "--concurrency", "1", "--timeout", "5", "--wait-for-server", "1"], capfd)
    refused(res, {}, tmp_path / "ev", url, "not ready after 1 s (--wait-for-server)")


def test_05_waits_for_a_server_that_is_still_loading(chain, tmp_path, capfd):
    """`vllm serve ... &` then 05 --base-url: 05 waits while the stand-in loads (/health 503 for
    2 s after the first probe), then goes on, and is refused for what the stand-in is not (it has
    no vLLM /metrics): the wait let it through to the next check."""
    prompts = write_prompts(tmp_path / "p.jsonl", ["a"], ids=["unseen"])
    fs = FaultServer(tmp_path, "--loading", "2").start(ready=False)
    try:
        res = run_inprocess("05_evaluate", ["--draft", chain.run / "export", "--prompts", prompts, "--arms", "eagle3",
                                            "--base-url", fs.url, "--output-dir", tmp_path / "ev", "--num-prompts",
                                            "1", "--concurrency", "1", "--timeout", "5", "--wait-for-server", "600"],
                            capfd)
    finally:
        fs.stop()
    refused(res, {}, tmp_path / "ev", "cannot read", f"{fs.url.removesuffix('/v1')}/metrics")
    log = (tmp_path / "ev" / "progress.log").read_text()
    assert f"05 eagle3 waiting for {fs.url} (loading: " in log and " of 10m" in log, log


class _Junk(http.server.BaseHTTPRequestHandler):
    """A server that answers everything with 200 and a body that is not what the API says: an
    HTML error page from a proxy, or JSON of the wrong shape."""
    body = b""
    ctype = "text/html"

    def _send(self):
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        self.send_response(200)
        self.send_header("Content-Type", self.ctype)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    do_GET = do_POST = _send

    def log_message(self, *a):
        pass


@pytest.fixture
def junk_server():
    servers = []

    def start(body: bytes, ctype: str) -> str:
        handler = type("H", (_Junk,), {"body": body, "ctype": ctype})
        srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        return f"http://127.0.0.1:{srv.server_address[1]}/v1"

    yield start
    for s in servers:
        s.shutdown()
        s.server_close()


@pytest.mark.parametrize("body, ctype", [
    (b"<html><body><h1>502 Bad Gateway</h1></body></html>", "text/html"),
    (b'{"object": "list", "models": "not the OpenAI schema"}', "application/json"),
], ids=["non-json", "wrong-schema"])
def test_01b_server_answering_junk(body, ctype, tmp_path, junk_server, capfd):
    """Every answer (the model list and each completion) is junk: one line, exit 2, and the
    prompts stay pending (nothing is recorded as answered)."""
    prompts = write_prompts(tmp_path / "p.jsonl", [f"q{i}" for i in range(6)])
    out = tmp_path / "gen"
    res = run01b(prompts, out, junk_server(body, ctype), capfd, "--abort-after", "3", "--concurrency", "1")
    refused(res, {}, out)
    raw = out / "raw_responses.jsonl"
    assert not raw.exists() or not raw.read_bytes()


def test_01b_completions_with_wrong_schema_abort_after_a_streak(tmp_path, capfd, k25_tokenizer_dir):
    """/models is fine but every completion is valid JSON without `choices`."""
    prompts = write_prompts(tmp_path / "p.jsonl", [f"q{i}" for i in range(6)])
    with FaultServer(tmp_path, "--schedule", "schema", "--cycle") as fs:
        res = run01b(prompts, tmp_path / "gen", fs.url, capfd, "--abort-after", "3", "--concurrency", "1")
    refused(res, {}, tmp_path / "gen", "3 requests in a row", "bad_schema")
    errs = [json.loads(x) for x in (tmp_path / "gen" / "errors.jsonl").read_text().splitlines()]
    assert {e["error_type"] for e in errs} == {"bad_schema"} and len(errs) == 3


# ----------------------------------------------------------------------------- 01c inputs

def raw_input(raw_dir: Path, tmp_path: Path, fn) -> Path:
    """A 01b output whose records were bad when 01b finished: the manifest describes the edited
    file (01c refuses a file changed after its manifest: test_01c_raw_file_changed_after_01b)."""
    from eagle3_train.common.manifest import describe_file

    d = copy(raw_dir, tmp_path / "raw")
    edit_jsonl(d / "raw_responses.jsonl", fn)
    man = json.loads((d / "manifest.json").read_text())
    man["outputs"]["raw_responses"] = describe_file(d / "raw_responses.jsonl")
    man["counts"]["records_in_file"] = len((d / "raw_responses.jsonl").read_text().splitlines())
    (d / "manifest.json").write_text(json.dumps(man))
    return d


def run01c(raw: Path, out: Path, tok: Path, capfd, *extra) -> Result:
    return run_inprocess("01c_tokenize", ["--raw-dir", raw, "--output-dir", out, "--tokenizer", tok, *extra], capfd)


def test_01c_malformed_line(raw_dir, tmp_path, capfd, k25_tokenizer_dir):
    raw = raw_input(raw_dir, tmp_path, lambda i, r: '{"id": "q003", "messages": [' if i == 3 else r)
    before = snapshot(raw)
    refused(run01c(raw, tmp_path / "tok", k25_tokenizer_dir, capfd), {raw: before}, tmp_path / "tok",
            "raw_responses.jsonl:4", "malformed")


def test_01c_missing_fields(raw_dir, tmp_path, capfd, k25_tokenizer_dir):
    raw = raw_input(raw_dir, tmp_path,
                    lambda i, r: {k: v for k, v in r.items() if k != "messages"} if r["id"] == "q002" else r)
    before = snapshot(raw)
    refused(run01c(raw, tmp_path / "tok", k25_tokenizer_dir, capfd), {raw: before}, tmp_path / "tok",
            "q002", "prompt")


def test_01c_empty_prompt(raw_dir, tmp_path, capfd, k25_tokenizer_dir):
    raw = raw_input(raw_dir, tmp_path, lambda i, r: {**r, "messages": [{"role": "user", "content": ""}],
                                                     "prompt_token_ids": None} if r["id"] == "q001" else r)
    before = snapshot(raw)
    refused(run01c(raw, tmp_path / "tok", k25_tokenizer_dir, capfd), {raw: before}, tmp_path / "tok",
            "q001", "empty prompt")


def test_01c_token_ids_from_another_tokenizer(raw_dir, tmp_path, capfd, k25_tokenizer_dir):
    raw = raw_input(raw_dir, tmp_path,
                    lambda i, r: {**r, "token_ids": [*r["token_ids"][:-1], 163586]} if r["id"] == "q005" else r)
    before = snapshot(raw)
    refused(run01c(raw, tmp_path / "tok", k25_tokenizer_dir, capfd), {raw: before}, tmp_path / "tok",
            "q005", "163586")


def _empty_answer(r: dict, think_end: int, im_end: int) -> dict:
    return {**r, "reasoning": "", "content": "", "token_ids": [think_end, im_end]}


def test_01c_empty_answers_are_dropped_and_counted(raw_dir, tmp_path, capfd, k25_tokenizer, k25_tokenizer_dir):
    """An answer with neither reasoning nor content (the server gave up, or a refusal to think and
    answer) teaches only `</think><|im_end|>`: dropped and counted, like a prompt too long, never
    silently trained on."""
    te, ie = k25_tokenizer.convert_tokens_to_ids("</think>"), k25_tokenizer.convert_tokens_to_ids("<|im_end|>")
    raw = raw_input(raw_dir, tmp_path, lambda i, r: _empty_answer(r, te, ie) if r["id"] in ("q002", "q006") else r)
    res = run01c(raw, tmp_path / "tok", k25_tokenizer_dir, capfd)
    assert res.rc == 0, res.stderr
    ids = [json.loads(x)["id"] for x in (tmp_path / "tok" / "data.jsonl").read_text().splitlines()]
    assert "q002" not in ids and "q006" not in ids, "empty answers were kept as training samples"
    counts = json.loads((tmp_path / "tok" / "manifest.json").read_text())["counts"]
    assert any("empty" in k and v == 2 for k, v in counts.items()), counts


def test_01c_only_empty_answers_is_an_error(raw_dir, tmp_path, capfd, k25_tokenizer, k25_tokenizer_dir):
    te, ie = k25_tokenizer.convert_tokens_to_ids("</think>"), k25_tokenizer.convert_tokens_to_ids("<|im_end|>")
    raw = raw_input(raw_dir, tmp_path, lambda i, r: _empty_answer(r, te, ie))
    before = snapshot(raw)
    refused(run01c(raw, tmp_path / "tok", k25_tokenizer_dir, capfd), {raw: before}, tmp_path / "tok", "no sample")


def tokenizer_without_think(src: Path, dst: Path) -> Path:
    """The k25 tokenizer with its think tokens renamed: a non-reasoning model's tokenizer."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".complete"))
    for p in dst.iterdir():
        if p.is_file() and p.suffix in (".json", ".jinja", ""):
            text = p.read_text()
            p.write_text(text.replace("</think>", "</reason>").replace("<think>", "<reason>"))
    return dst


def test_01c_tokenizer_without_think_tokens(raw_dir, tmp_path, capfd, k25_tokenizer_dir):
    tok = tokenizer_without_think(k25_tokenizer_dir, tmp_path / "nothink")
    before = snapshot(raw_dir)
    refused(run01c(raw_dir, tmp_path / "tok", tok, capfd), {raw_dir: before}, tmp_path / "tok",
            "think", "--no-reasoning")


def test_01c_prompt_longer_than_max_length(raw_dir, tmp_path, capfd, k25_tokenizer_dir):
    """Samples whose prompt fills --max-seq-len are dropped and counted; if that leaves none, it is
    an error naming the reason."""
    raw = (raw_dir / "raw_responses.jsonl").read_text().splitlines()
    lens = sorted(len(json.loads(x)["prompt_token_ids"]) for x in raw)
    cut = lens[len(lens) // 2]  # at least half the prompts fill it
    res = run01c(raw_dir, tmp_path / "tok", k25_tokenizer_dir, capfd, "--max-seq-len", cut)
    assert res.rc == 0, res.stderr
    counts = json.loads((tmp_path / "tok" / "manifest.json").read_text())["counts"]
    dropped = counts["dropped_no_supervised_tokens"]
    assert dropped >= 1 and counts["samples"] + dropped == len(lens), counts
    assert "no supervised tokens" in res.stdout and str(dropped) in res.stdout
    before = snapshot(raw_dir)
    refused(run01c(raw_dir, tmp_path / "tok2", k25_tokenizer_dir, capfd, "--max-seq-len", lens[0] - 1),
            {raw_dir: before}, tmp_path / "tok2", "no sample left", "no_supervised_tokens")


# ----------------------------------------------------------------------------- 02's shards in 04 and 05

def val_ids(chain: Chain) -> set[str]:
    """04's validation split: the samples 05 evaluates offline."""
    return set(json.loads((chain.run / "manifest.json").read_text())["split"]["val_ids"])


def heldout_shard(chain: Chain) -> str:
    """A shard holding a sample of 04's validation split."""
    val = val_ids(chain)
    for line in (chain.hs / "index.jsonl").read_text().splitlines():
        e = json.loads(line)
        if val & set(e["ids"]):
            return e["shard"]
    raise AssertionError("no shard holds a validation sample")


def store_copy(chain: Chain, tmp_path: Path, damage) -> tuple[Path, str]:
    d = copy(chain.hs, tmp_path / "hs")
    name = heldout_shard(chain)
    damage(d / name, val_ids(chain))
    return d, name


def truncate(p: Path, val: set[str]) -> None:
    p.write_bytes(p.read_bytes()[: p.stat().st_size * 2 // 3])


def put_nan(p: Path, val: set[str]) -> None:
    """A NaN inside a shard that is otherwise whole (same size, valid header and metadata), in a
    validation sample's rows so that 05, which reads only those, meets it as well as 04."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(str(p), "pt") as f:
        meta = f.metadata()
    t = load_file(str(p))
    key = "aux_scale" if "aux_scale" in t else "aux"
    layout = json.loads(meta["eagle3"])
    row = next(off for sid, off in zip(layout["ids"], layout["offsets"]) if sid in val)
    t[key][row + 1].view(-1)[0] = float("nan")
    save_file(t, str(p), metadata=meta)


def run_04_05(stage: str, chain: Chain, store: Path, out: Path, capfd) -> Result:
    if stage == "04":
        return run_inprocess("04_train", chain.argv04(out, hs=store), capfd)
    return run_inprocess("05_evaluate", ["--draft", chain.run / "export", "--store", store, "--output-dir", out], capfd)


@pytest.mark.parametrize("stage", ["04", "05"])
def test_truncated_shard(stage, chain, tmp_path, capfd):
    store, name = store_copy(chain, tmp_path, truncate)
    before = snapshot(store)
    refused(run_04_05(stage, chain, store, tmp_path / "out", capfd), {store: before}, tmp_path / "out", name)


@pytest.mark.parametrize("stage", ["04", "05"])
def test_shard_with_nan(stage, chain, tmp_path, capfd):
    """A NaN in the stored features must stop the run with the shard named, not train (04) or
    score (05) on it."""
    store, name = store_copy(chain, tmp_path, put_nan)
    before = snapshot(store)
    refused(run_04_05(stage, chain, store, tmp_path / "out", capfd), {store: before}, tmp_path / "out", name)


# ----------------------------------------------------------------------------- aux layers (02, 04)
# vLLM gathers the aux states ascending, each once, from layers 1..N: a list it would serve
# differently from how the draft was trained is refused (an unsorted one is sorted: test_extract).

@pytest.mark.parametrize("layers, needles", [
    ("2,4,4", ("--layers", "layer 4 listed more than once")),
    ("0,2,4", ("--layers", "id 0")),
], ids=["layer-repeated", "layer-zero"])
def test_02_bad_layers(layers, needles, chain, tmp_path, capfd):
    data = chain.tokenized
    before = snapshot(data)
    out = tmp_path / "hs"
    res = run_inprocess("02_extract_hidden_states", [*chain.argv02(out), "--layers", layers], capfd)
    refused(res, {data: before}, out, *needles)


@pytest.mark.parametrize("ids, needles", [
    ("2,4,4", ("--aux-layer-ids", "layer 4 listed more than once")),
    ("0,2", ("--aux-layer-ids", "id 0")),
], ids=["layer-repeated", "layer-zero"])
def test_04_bad_aux_layer_ids(ids, needles, chain, tmp_path, capfd):
    before = snapshot(chain.hs)
    out = tmp_path / "run"
    res = run_inprocess("04_train", [*chain.argv04(out), "--aux-layer-ids", ids], capfd)
    refused(res, {chain.hs: before}, out, *needles)


def test_04_store_with_a_repeated_layer(chain, tmp_path, capfd):
    """A store an older 02 made with a repeated id (its default for a 6-layer target was 2,3,3)."""
    store = copy(chain.hs, tmp_path / "hs")
    man = json.loads((store / "manifest.json").read_text())
    n = man["layer_ids"][-1]
    man["aux_layer_ids"] = [2, 4, 4]
    man["layer_ids"] = [2, 4, 4, n]
    (store / "manifest.json").write_text(json.dumps(man))
    before = snapshot(store)
    out = tmp_path / "run"
    refused(run_04_05("04", chain, store, out, capfd), {store: before}, out, "[2, 4, 4]", "--aux-layer-ids 2,4")


# ----------------------------------------------------------------------------- flags refused at parse
# A flag no run can use, or one that only matters beside another flag that is missing, is one line
# naming the flag and the fix, exit 2, before any server is asked and before anything is written.
# The stages run in this process; {tmp}, {url} (a server that records every request) and {k25}
# (a real tokenizer) are filled in per test.

PLAN_TARGET = str(Path(__file__).parents[1] / "docs" / "kimi-k2.5-text-config.json")
CLIS = {"00_preflight": "preflight", "00_plan": "plan", "01b": "generate", "01c": "tokenize",
        "02": "extract", "03": "vocab", "04": "train", "05": "evaluate", "pilot": "pilot",
        "01": "split_prompts", "01b-capture": "generate", "status": "status", "gpu_check": None}
BASE = {
    "00_preflight": ["--allreduce-procs", "0"],
    "00_plan": ["--target", PLAN_TARGET],
    "01b": ["--input", "{tmp}/p.jsonl", "--output-dir", "{tmp}/gen", "--model", "kimi-k2.5", "--base-url", "{url}"],
    "01c": ["--raw-dir", "{tmp}/gen", "--tokenizer", "{k25}"],
    "02": ["--input", "{tmp}/tok", "--model", "{tmp}/target", "--output-dir", "{tmp}/hs"],
    "03": ["--data", "{tmp}/tok", "--target", "{tmp}/target", "--output-dir", "{tmp}/vocab"],
    "04": ["--hidden-states", "{tmp}/hs", "--vocab-mapping", "{tmp}/vocab", "--target", "{tmp}/target",
           "--out", "{tmp}/run"],
    "05": ["--draft", "{tmp}/run/export", "--output-dir", "{tmp}/eval"],
    "pilot": ["--target", "{tmp}/target", "--input", "{tmp}/p.jsonl", "--work-dir", "{tmp}/work"],
    "01": ["--input", "{tmp}/p.jsonl", "--output-dir", "{tmp}/split", "--heldout", "1"],
    "01b-capture": ["--input", "{tmp}/p.jsonl", "--output-dir", "{tmp}/gen", "--model", "kimi-k2.5",
                    "--capture-hidden-states", "--target", "{tmp}/target"],
    "status": [],
    "gpu_check": ["--out", "{tmp}/gpu"],
}
ONLINE = ["--prompts", "{tmp}/p.jsonl"]
PARSE_CASES = [
    # -- found by the probe
    ("04", ["--draft-arch", "dflash", "--attn", "eager"], ("--attn eager", "sdpa", "flex")),
    ("04", ["--draft-arch", "dflash", "--mask-token-id", "-3"], ("--mask-token-id", "-3")),
    ("05", ["--store", "{tmp}/hs", "--arms", "eagle3,medusa"], ("--arms", "'medusa'", "eagle3, none, ngram")),
    ("05", [*ONLINE, "--arms", "eagle3,medusa"], ("--arms", "'medusa'", "eagle3, none, ngram")),
    ("00_preflight", ["--work-dir", "{tmp}/p.jsonl"], ("--work-dir", "is a file")),
    ("05", [*ONLINE, "--k-sweep", "-1,3"], ("--k-sweep", "positive", "-1,3")),
    ("01b", ["--capture-hidden-states"], ("--capture-hidden-states needs --target", "'kimi-k2.5'")),
    ("01b", ["--max-store-gb", "5"], ("--max-store-gb", "add --capture-hidden-states")),
    ("01b", ["--extra-body", '{"kv_transfer_params": 5}'], ("--extra-body", "kv_transfer_params", "JSON object")),
    # -- the same kinds of flag elsewhere
    ("04", ["--draft-arch", "dflash", "--ttt-steps", "7"], ("--ttt-steps", "block draft")),
    ("04", ["--block-gamma", "2"], ("--block-gamma", "add --draft-arch dflash")),
    ("04", ["--follow-timeout", "60"], ("--follow-timeout", "add --follow")),
    ("04", ["--ttt-decay", "-0.5,1,1"], ("--ttt-decay", "negative")),
    ("04", ["--beta2", "1"], ("--beta1 and --beta2", "[0, 1)")),
    ("04", ["--optimizer", "adamw", "--muon-weight-decay", "0.2"], ("--muon-weight-decay", "muon")),
    ("04", ["--warmup-steps", "10", "--warmup-ratio", "0.1"], ("--warmup-steps", "--warmup-ratio", "give one")),
    ("05", [*ONLINE, "--concurrency", "-1,4"], ("--concurrency", "positive", "-1,4")),
    ("05", [*ONLINE, "--ngram", "5,2"], ("--ngram", "MIN <= MAX")),
    ("05", [*ONLINE, "--arms", "none", "--base-url", "{url}"], ("--base-url", "arm eagle3", "--arms")),
    ("05", ["--store", "{tmp}/hs", "--url", "none={url}"], ("--url", "add --prompts")),
    ("05", [*ONLINE, "--offline-dtype", "bf16"], ("--offline-dtype", "add --store")),
    ("05", [*ONLINE, "--top-p", "0"], ("--top-p", "(0, 1]")),
    ("05", [*ONLINE, "--arms", "none,ngram", "--k-sweep", "3,5"], ("--k-sweep", "eagle3 arm")),
    ("01b", ["--extra-body", '{"stream": true}'], ("--extra-body", "'stream'")),
    ("01b", ["--extra-body", '{"max_tokens": 9}'], ("--extra-body", "'max_tokens'", "--max-tokens")),
    ("01b", ["--target", "{tmp}/target"], ("--target", "add --capture-hidden-states")),
    ("01b", ["--max-seq-len", "100"], ("--max-seq-len", "add --tokenize")),
    ("01b", ["--tokenize", "--think-end-id", "-1"], ("--think-end-id", "-1")),
    ("01b", ["--tokenize", "--tokenizer", "{k25}", "--think-end-id", "99999999"],
     ("--think-end-id 99999999", "vocabulary")),
    ("01c", ["--no-reasoning", "--think-end-id", "5"], ("--no-reasoning", "--think-end-id")),
    ("02", ["--server-url", "{url}"], ("--server-url", "--backend vllm")),
    ("03", ["--coverage-sizes", "-5", "100"], ("--coverage-sizes", "positive")),
    ("03", ["--freq-from", "{tmp}/vocab", "--recount"], ("--freq-from", "--recount")),
    ("00_plan", ["--block-size", "4"], ("--block-size", "--draft-arch dflash")),
    ("00_plan", ["--draft-arch", "dflash", "--attn", "eager"], ("--attn eager", "sdpa")),
    ("00_plan", ["--draft-arch", "dflash", "--block-size", "4", "--num-speculative-tokens", "5"],
     ("--num-speculative-tokens 5", "--block-size 4")),
    ("00_plan", ["--topk", "16"], ("--topk", "--storage fp8-topk")),
    ("00_preflight", ["--out", "{tmp}"], ("--out", "is a directory")),
    ("00_preflight", ["--plan", "{tmp}/no-plan.json"], ("--plan",)),
    ("05", [*ONLINE, "--arms", "eagle3", "--base-url", "{url}", "--max-model-len", "4096"],
     ("--max-model-len", "every arm in --arms has a --url")),
    ("pilot", ["--base-url", "{url}", "--model", "m", "--max-model-len", "4096"], ("--max-model-len", "--base-url")),
    ("pilot", ["--budget", "-5m"], ("--budget", "positive")),
    ("pilot", ["--storage", "fp9"], ("--storage", "'fp9'", "fp8-topk")),
    ("pilot", ["--work-dir", "{tmp}/p.jsonl"], ("--work-dir", "is a file")),
    ("pilot", ["--screen-only", "{tmp}/gen", "--budget", "5"], ("--screen-only", "--budget")),
    # -- 01b's --concurrency auto controller and its endpoints
    ("01b", ["--concurrency", "8", "--max-concurrency", "64"], ("--max-concurrency", "--concurrency auto", "drop it")),
    ("01b", ["--concurrency", "8", "--concurrency-every", "5"], ("--concurrency-every", "--concurrency auto")),
    ("01b", ["--concurrency", "8", "--max-concurrency", "64", "--concurrency-every", "5"],
     ("--max-concurrency, --concurrency-every", "drop them")),
    ("01b", ["--concurrency-every", "inf"], ("--concurrency-every must be positive", "inf")),
    ("01b", ["--base-url", "{url}"], ("--base-url", "repeats", "give each endpoint once")),
    ("01b", ["--base-url", "{url}/"], ("--base-url", "repeats", "give each endpoint once")),
    ("01b", ["--base-url", "127.0.0.1:8000/v1"], ("--base-url", "not an http(s) URL", "http://127.0.0.1:8000/v1")),
    ("01b", ["--base-url", "ftp://127.0.0.1:8000/v1"], ("--base-url", "write http://127.0.0.1:8000/v1")),
    # -- --wait-for-server values, and where nothing waits
    ("01b", ["--wait-for-server", "inf"], ("--wait-for-server", "not inf", "86400")),
    ("01b", ["--wait-for-server", "30m"], ("--wait-for-server", "'30m'", "1800")),
    ("01b-capture", ["--launch-server", "--wait-for-server", "60"], ("--wait-for-server", "--startup-timeout")),
    ("05", [*ONLINE, "--wait-for-server", "60"], ("--wait-for-server", "started here", "drop")),
    ("05", [*ONLINE, "--base-url", "{url}", "--wait-for-server", "soon"], ("--wait-for-server", "'soon'", "seconds")),
    ("02", ["--backend", "vllm", "--launch-server", "--wait-for-server", "60"], ("--wait-for-server", "--server-url")),
    ("02", ["--backend", "vllm", "--server-url", "{url}", "--wait-for-server", "inf"], ("--wait-for-server", "86400")),
    # -- 05's arms, servers and sweeps
    ("05", [*ONLINE, "--arms", "eagle3,none,eagle3"], ("--arms", "eagle3 more than once", "each arm once")),
    ("05", [*ONLINE, "--k-sweep", "3,5,3"], ("--k-sweep", "3 more than once", "once")),
    ("05", [*ONLINE, "--concurrency", "1,4,4"], ("--concurrency", "4 more than once", "once")),
    ("05", [*ONLINE, "--url", "eagle3={url}", "--base-url", "{url}"], ("--base-url", "--url eagle3=", "give one")),
    ("05", [*ONLINE, "--arms", "eagle3,none", "--url", "none={url}", "--url", "none={url}/"],
     ("--url", "arm none twice", "give one")),
    ("05", [*ONLINE, "--url", "eagle3="], ("--url eagle3=", "not an http(s) URL", "http://127.0.0.1:8000/v1")),
    ("05", [*ONLINE, "--base-url", "localhost:8000/v1"], ("--base-url", "http://localhost:8000/v1")),
    # -- 02's storage and server
    ("02", ["--topk", "16"], ("--topk", "--storage fp8-topk", "drop --topk")),
    ("02", ["--backend", "vllm", "--server-url", "{url}", "--launch-server"],
     ("--server-url", "--launch-server", "give one")),
    ("02", ["--backend", "vllm", "--server-url", "localhost:8000/v1"], ("--server-url", "http://localhost:8000/v1")),
    # -- the held-out split
    ("01", ["--heldout", "inf"], ("--heldout must be positive", "inf")),
    ("01", ["--heldout", "nan"], ("--heldout must be positive", "nan")),
    ("01", ["--heldout", "2.5"], ("--heldout 2.5", "whole number")),
    ("01", ["--heldout", "2"], ("--heldout 2", "none left to train on", "smaller --heldout")),
    ("01", ["--input", "{tmp}/train.jsonl", "--output-dir", "{tmp}"],
     ("--input", "train.jsonl", "another --output-dir")),
    # -- the status view
    ("status", ["{tmp}/p.jsonl"], ("WORK", "is not a directory")),
    ("status", ["{tmp}/nothere"], ("WORK", "does not exist")),
    ("status", [""], ("WORK is empty", "$W")),
    # -- the GPU check's device profile
    ("gpu_check", ["--make-kit", "--profile", "device"], ("--profile", "--make-kit", "run it alone")),
    ("gpu_check", ["--make-kit", "--dry-run"], ("--dry-run", "--make-kit")),
    ("gpu_check", ["--profile", "device", "--device", "cpu"],
     ("--device", "not read by --profile device", "--dry-run")),
    ("gpu_check", ["--profile", "device", "--samples", "4", "--draft", "{tmp}"], ("--samples, --draft", "drop them")),
    ("gpu_check", ["--dry-run", "--budget-s", "0"], ("--budget-s", "positive", "0.0")),
    ("gpu_check", ["--dry-run", "--only", "04,05,04"], ("--only", "04 more than once")),
    ("gpu_check", ["--dry-run", "--out", "{tmp}/p.jsonl"], ("--out", "is a file", "folder")),
    ("gpu_check", ["--profile", "device", "--dry-run", "--only", "04"], ("--only", "unknown step", "04-mla")),
    # -- ids checked against the target's vocabulary and layers (03's at its start: test_03_ids...)
    ("03", ["--end-of-turn-id", "-2"], ("--end-of-turn-id", "token id", "-2")),
]


class _Recorder(_Junk):
    """Answers like _Junk and records every request: a refused run must have asked nothing."""
    hits: list = []

    def _send(self):
        self.hits.append(self.path)
        super()._send()

    do_GET = do_POST = _send


@pytest.fixture
def recorder():
    handler = type("R", (_Recorder,), {"hits": [], "body": b"{}", "ctype": "application/json"})
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/v1", handler.hits
    srv.shutdown()
    srv.server_close()


def cli_main(key: str):
    import importlib
    import sys

    if CLIS[key] is None:  # scripts/gpu_check.py: imported as it is run (tests/test_gpu_check.py)
        scripts = str(Path(__file__).parents[1] / "scripts")
        sys.path.insert(0, scripts)
        try:
            return importlib.import_module(key).main
        finally:
            sys.path.remove(scripts)
    return importlib.import_module(f"eagle3_train.{CLIS[key]}.cli").main


def run_cli(key: str, argv: list[str], capfd) -> Result:
    """A stage's main() (or the pilot's) through errors.run_main, as reliability.run_inprocess runs one."""
    from eagle3_train.common.errors import run_main

    main = cli_main(key)
    capfd.readouterr()
    try:
        rc = run_main(main, argv)
    except SystemExit as e:  # argparse's own refusals
        rc = e.code if isinstance(e.code, int) else 2
    except BaseException as e:  # noqa: BLE001 -- a traceback for a user: assert_one_error_line reports it
        out, err = capfd.readouterr()
        return Result(1, out, f"{err}Traceback (escaped run_main): {type(e).__name__}: {e}")
    out, err = capfd.readouterr()
    return Result(rc, out, err)


@pytest.mark.parametrize("key, argv, needles", PARSE_CASES,
                         ids=[f"{k} {' '.join(a)}".replace("{tmp}/", "").replace("{url}", "URL").replace("{k25}", "K25")
                              for k, a, _ in PARSE_CASES])
def test_flags_refused_before_any_request_or_write(key, argv, needles, tmp_path, recorder, k25_tokenizer_dir, capfd):
    url, hits = recorder
    write_prompts(tmp_path / "p.jsonl", ["a", "b"])
    write_prompts(tmp_path / "train.jsonl", ["c", "d"])  # a split's own file, given back as its input
    fill = {"{tmp}": str(tmp_path), "{url}": url, "{k25}": str(k25_tokenizer_dir)}

    def filled(a: str) -> str:
        for k, v in fill.items():
            a = a.replace(k, v)
        return a

    before = snapshot(tmp_path)
    res = run_cli(key, [filled(a) for a in [*BASE[key], *argv]], capfd)
    assert_one_error_line(res, *needles)
    assert_unchanged(before, tmp_path, allow_new=lambda rel: False)
    assert hits == [], f"a refused run asked the server: {hits}"


def test_04_mask_token_id_outside_the_target_vocab(chain, tmp_path, capfd):
    """Checked against the vocabulary in the target's config (read before anything is written), not
    trained and exported into config.json for vLLM to index past its embedding."""
    before = snapshot(chain.hs)
    out = tmp_path / "run"
    res = run_inprocess("04_train", [*chain.argv04(out), "--draft-arch", "dflash", "--mask-token-id", "99999999"],
                        capfd)
    refused(res, {chain.hs: before}, out, "--mask-token-id 99999999", "vocabulary has", "pass one below")
    assert not out.exists()


@pytest.mark.parametrize("stage, flags, needles", [
    ("03", ["--think-end-id", "99999999"], ("--think-end-id 99999999", "not a token of the target", "pass its id")),
    ("03", ["--end-of-turn-id", "99999999"], ("--end-of-turn-id 99999999", "not a token of the target")),
    ("03", ["--coverage-sizes", "64", "99999999"], ("--coverage-sizes 99999999", "exceed", "pass sizes up to")),
    ("04", ["--aux-layer-ids", "2,99"], ("--aux-layer-ids", "99")),
    ("04", ["--aux-layer-ids", "1,3"], ("--aux-layer-ids", "1")),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_ids_checked_against_the_target(stage, flags, needles, chain, tmp_path, capfd):
    """Token ids and layer ids that the target (read before any work) does not have: one line naming
    the flag and the id, nothing written, the inputs untouched."""
    data = chain.tokenized if stage == "03" else chain.hs
    before = snapshot(data)
    out = tmp_path / "out"
    if stage == "03":
        res = run_inprocess("03_build_vocab_mapping", [*chain.argv03(out), *flags], capfd)
    else:
        res = run_inprocess("04_train", [*chain.argv04(out), *flags], capfd)
    refused(res, {data: before}, out, *needles)
    assert not out.exists() or not any(out.iterdir()), sorted(p.name for p in out.iterdir())


def test_01b_tokenize_loads_the_tokenizer_once(tmp_path, fault_server, k25_tokenizer_dir, capfd, monkeypatch):
    """01b --tokenize reads the tokenizer before any request (its ids checked there) and tokenizes the
    answers with that same one."""
    from eagle3_train.common import tokenization

    loads, load = [], tokenization.load_tokenizer
    monkeypatch.setattr(tokenization, "load_tokenizer", lambda name: loads.append(name) or load(name))
    prompts = write_prompts(tmp_path / "p.jsonl", ["a", "b"])
    res = run01b(prompts, tmp_path / "gen", fault_server.url, capfd, "--tokenize", "--tokenizer", k25_tokenizer_dir)
    assert res.rc == 0, res.stderr
    assert (tmp_path / "gen" / "tokenized" / "manifest.json").exists() and loads == [str(k25_tokenizer_dir)]


def test_03_draft_vocab_size_past_the_target_is_clamped_with_one_warning(chain, tmp_path, capfd):
    """Clamped, not refused: 03's default K (32000) is sized for large targets, and on a smaller one
    the whole vocabulary is the only draft vocabulary it can mean; one warning names the flag, the
    size used and how to choose another."""
    from eagle3_train.vocab import mapping as vocab

    out = tmp_path / "vocab"
    res = run_inprocess("03_build_vocab_mapping", [*chain.argv03(out), "--draft-vocab-size", "10000000"], capfd)
    assert res.rc == 0, res.stderr
    m = vocab.read_mapping(out)
    v = m.target_vocab_size
    warned = [ln for ln in res.stderr.splitlines() if "--draft-vocab-size" in ln]
    assert warned == [f"warning: --draft-vocab-size 10000000 exceeds the target vocabulary; using {v} (all of it; "
                      f"pass --draft-vocab-size {v} or less to choose)"], res.stderr
    assert m.draft_vocab_size == v and m.manifest["draft_vocab_size"] == v


@pytest.mark.parametrize("which, needle", [("missing", "no such directory"), ("empty", "holds none of tokenizer.json")])
def test_01c_tokenizer_path_that_is_no_tokenizer(which, needle, raw_dir, tmp_path, capfd):
    """A --tokenizer path that is missing or holds no tokenizer is named as such (not read as a hub id)."""
    tok = tmp_path / which
    if which == "empty":
        tok.mkdir()
    raw = raw_input(raw_dir, tmp_path, lambda i, r: r)
    before = snapshot(raw)
    refused(run01c(raw, tmp_path / "tok", tok, capfd), {raw: before}, tmp_path / "tok", str(tok), needle)
