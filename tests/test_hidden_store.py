"""The hidden-state store on its own: sizes, fp8 round trip, shards + index, plan, validation."""

import json

import pytest
import torch
from eagle3_train.common import hidden_store as hs
from eagle3_train.common.errors import PipelineError
from eagle3_train.common.hidden_checks import validate_shard
from eagle3_train.common.manifest import write_manifest
from safetensors.torch import load_file, save_file

H, NAUX, K = 16, 3, 4


def test_bytes_per_token_and_the_compact_goal():
    assert hs.bytes_per_token("bf16", 3, 7168) == 5 + 4 * 7168 * 2
    assert hs.bytes_per_token("fp32", 3, 128) == 5 + 4 * 128 * 4
    assert hs.bytes_per_token("fp8", 3, 128) == 5 + 4 * (128 + 4)
    assert hs.bytes_per_token("fp8-topk", 3, 128, 8) == 5 + 3 * (128 + 4) + 8 * 6
    # Kimi-K2.5 (hidden 7168, aux 2/30/58): fp8-topk stores under 40% of bf16's bytes per token.
    kimi = hs.describe_storage("fp8-topk", 3, 7168, 32)
    assert kimi["share_of_bf16"] <= hs.COMPACT_GOAL
    assert hs.describe_storage("fp8", 3, 7168)["share_of_bf16"] == pytest.approx(0.5, abs=0.01)
    with pytest.raises(PipelineError, match="unknown storage"):
        hs.bytes_per_token("int4", 3, 128)


def test_fp8_round_trip_error_is_relative_to_each_token():
    g = torch.Generator().manual_seed(0)
    # Rows of very different magnitude: one scale per row keeps small rows precise.
    x = torch.randn(64, NAUX, H, generator=g) * torch.logspace(-3, 3, 64).view(64, 1, 1)
    q, scale = hs.quantize_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (64, NAUX)
    y = hs.dequantize_fp8(q, scale)
    amax = x.abs().amax(-1, keepdim=True)
    # e4m3: 3 mantissa bits -> half-ulp relative error 2^-4; values near 0 get amax * 2^-9 absolute.
    assert ((y - x).abs() <= x.abs() * 2 ** -4 + amax * 2 ** -9 + 1e-30).all()
    zero_q, zero_s = hs.quantize_fp8(torch.zeros(2, H))
    assert torch.equal(hs.dequantize_fp8(zero_q, zero_s), torch.zeros(2, H))


def _store(tmp_path, storage, n_samples=3, topk=K, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = [5, 3, 7][:n_samples]
    T = sum(lengths)
    ids = torch.randint(0, 100, (T,), generator=g)
    mask = torch.randint(0, 2, (T,), generator=g)
    aux = torch.randn(T, NAUX, H, generator=g)
    last = torch.randn(T, H, generator=g)
    top = (torch.randint(0, 100, (T, topk), generator=g),
           torch.log_softmax(torch.randn(T, topk, generator=g), -1))
    tensors = hs.encode(storage, ids, mask, aux, last if storage != "fp8-topk" else None,
                        top if storage == "fp8-topk" else None)
    samples = [{"id": f"x{i}", "length": n} for i, n in enumerate(lengths)]
    entry = hs.write_shard(tmp_path, 0, samples, tensors, meta={"storage": storage})
    write_manifest(tmp_path, hs.STAGE, config={}, layer_ids=[1, 2, 3, 4], hidden_size=H,
                   storage=hs.describe_storage(storage, NAUX, H, topk if storage == "fp8-topk" else 0))
    return entry, ids, mask, aux, last, top, lengths


@pytest.mark.parametrize("storage", hs.STORAGES)
def test_each_storage_round_trips_through_the_reader(tmp_path, storage):
    entry, ids, mask, aux, last, top, lengths = _store(tmp_path, storage)
    # The file holds what bytes_per_token says (plus a small header).
    bpt = hs.bytes_per_token(storage, NAUX, H, K if storage == "fp8-topk" else 0)
    assert 0 <= entry["bytes"] - bpt * sum(lengths) < 2048
    reader = hs.HiddenStates(tmp_path)
    assert reader.ids == ["x0", "x1", "x2"] and reader.length("x2") == 7
    assert reader.has_last == (storage != "fp8-topk")
    tol = {"fp32": 0, "bf16": 2 ** -8, "fp16": 2 ** -11, "fp8": 2 ** -4, "fp8-topk": 2 ** -4}[storage]
    off = 0
    for sid, n in zip(reader.ids, lengths):
        s = reader.get(sid)
        sl = slice(off, off + n)
        assert torch.equal(s.input_ids, ids[sl]) and torch.equal(s.loss_mask, mask[sl].bool())
        assert s.aux.shape == (n, NAUX, H) and s.aux.dtype == torch.float32
        assert torch.allclose(s.aux, aux[sl], rtol=tol, atol=tol * aux[sl].abs().amax().item() / 8 + 1e-7)
        if storage == "fp8-topk":
            assert s.last is None
            assert torch.equal(s.topk_ids, top[0][sl])
            assert torch.allclose(s.topk_logprobs, top[1][sl], atol=2e-3)
        else:
            assert s.topk_ids is None
            assert torch.allclose(s.last, last[sl], rtol=tol, atol=tol * last[sl].abs().amax().item() / 8 + 1e-7)
        off += n
    with pytest.raises(PipelineError, match="not in"):
        reader.get("nope")


def test_plan_is_longest_first_and_cut_by_tokens():
    samples = [("a", 5), ("b", 9), ("c", 5), ("d", 2), ("e", 20)]
    plan = hs.make_plan(samples, shard_tokens=11)
    # longest first (ties in input order); a sample longer than a shard gets a shard of its own
    assert [s["ids"] for s in plan] == [["e"], ["b"], ["a", "c"], ["d"]]
    assert [s["tokens"] for s in plan] == [20, 9, 10, 2]
    assert hs.make_plan(samples, 11) == plan  # a pure function of its inputs


def test_plan_is_fixed_at_the_first_run(tmp_path):
    calls = []

    def make():
        calls.append(1)
        return hs.make_plan([("a", 3)], 10)

    p1 = hs.load_or_create_plan(tmp_path, make)
    p2 = hs.load_or_create_plan(tmp_path, make)
    assert p1 == p2 and len(calls) == 1 and p1["samples"] == 1 and p1["tokens"] == 3


def test_index_last_entry_wins_across_rank_files_and_dropped_uncommits(tmp_path):
    t = {"input_ids": torch.zeros(2, dtype=torch.int32)}
    hs.write_shard(tmp_path, 0, [{"id": "a", "length": 2}], t, index=hs.index_name(0, 2))
    hs.write_shard(tmp_path, 1, [{"id": "b", "length": 2}], t, index=hs.index_name(1, 2))
    assert sorted(hs.committed_shards(tmp_path)) == [0, 1]
    hs.drop_shards(tmp_path, [1])
    assert sorted(hs.committed_shards(tmp_path)) == [0]
    assert not (tmp_path / hs.shard_name(1)).exists()  # moved aside, not deleted
    assert len(list(tmp_path.glob("bad-*-shard-00001.safetensors"))) == 1
    hs.write_shard(tmp_path, 1, [{"id": "b", "length": 2}], t)
    assert sorted(hs.committed_shards(tmp_path)) == [0, 1]


def _check(tmp_path, entry, storage="bf16", expected=None):
    return validate_shard(tmp_path, entry, storage=storage, n_aux=NAUX, hidden=H, topk=0, expected=expected)


def test_validate_shard_catches_truncation_nan_wrong_ids_and_shapes(tmp_path):
    entry, ids, mask, *_ = _store(tmp_path, "bf16")
    truth = {"x0": (ids[:5].tolist(), mask[:5].tolist()), "x1": (ids[5:8].tolist(), mask[5:8].tolist()),
             "x2": (ids[8:].tolist(), mask[8:].tolist())}
    assert _check(tmp_path, entry, expected=truth.get) == []
    path = tmp_path / entry["shard"]
    data, raw = load_file(str(path)), path.read_bytes()
    from safetensors import safe_open
    meta = safe_open(str(path), "pt").metadata()

    # wrong token ids for one sample
    wrong = dict(truth, x1=([1, 2, 3], truth["x1"][1]))
    assert any("x1: token ids differ" in p for p in _check(tmp_path, entry, expected=wrong.get))
    # truncated file
    path.write_bytes(raw[: len(raw) // 2])
    assert "truncated" in _check(tmp_path, entry)[0]
    # NaN in place (same size)
    bad = dict(data)
    bad["aux"] = data["aux"].clone()
    bad["aux"][4, 1, 3] = float("nan")
    save_file(bad, str(path), metadata=meta)
    assert any("aux has 1 NaN/inf" in p for p in _check(tmp_path, entry))
    # wrong shape
    bad = dict(data)
    bad["last"] = torch.zeros(len(ids), H + 1, dtype=data["last"].dtype)
    save_file(bad, str(path), metadata=meta)
    e2 = dict(entry, bytes=path.stat().st_size)
    assert any("last has shape" in p for p in _check(tmp_path, e2))
    path.unlink()
    assert _check(tmp_path, entry) == ["file missing"]


def test_shard_metadata_describes_the_shard(tmp_path):
    entry, *_ = _store(tmp_path, "fp8")
    from safetensors import safe_open
    meta = safe_open(str(tmp_path / entry["shard"]), "pt").metadata()
    desc = json.loads(meta[hs.SHARD_META])
    assert desc["ids"] == ["x0", "x1", "x2"] and desc["storage"] == "fp8" and desc["lengths"] == [5, 3, 7]


def test_reader_keeps_a_bounded_number_of_shards_open(tmp_path, monkeypatch):
    import torch
    from eagle3_train.common import hidden_store
    from eagle3_train.common.hidden_store import HiddenStates, write_shard
    from eagle3_train.common.manifest import write_manifest

    for k in range(5):
        n = 3
        write_shard(tmp_path, k, [{"id": f"s{k}", "length": n}], {
            "input_ids": torch.arange(n, dtype=torch.int32), "loss_mask": torch.ones(n, dtype=torch.uint8),
            "aux": torch.full((n, 3, 4), float(k)).bfloat16(), "last": torch.zeros(n, 4).bfloat16()})
    write_manifest(tmp_path, hidden_store.STAGE, config={}, layer_ids=[1, 2, 3, 4], hidden_size=4)
    monkeypatch.setattr(hidden_store, "MAX_OPEN_SHARDS", 2)
    hs = HiddenStates(tmp_path)
    for sid in ["s0", "s1", "s2", "s3", "s4", "s0"]:
        assert float(hs.get(sid).aux[0, 0, 0]) == float(sid[1:])
        assert len(hs._open) <= 2
