"""The harness can fail: its views catch torn lines, duplicate ids, changed tensors and leftover
temp files, its moments are reproducible, and a crash sweep over a stage that does not resume
correctly fails (so a passing sweep over a real stage means something)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch
from reliability import (
    Reference,
    StageSpec,
    crash_trial,
    jsonl_view,
    moments,
    safetensors_view,
    strict_jsonl,
    sweep,
    tree_view,
)
from safetensors.torch import save_file


def test_jsonl_views_reject_torn_lines_and_duplicates_and_ignore_order_and_volatile_fields(tmp_path):
    p = tmp_path / "a.jsonl"
    p.write_text('{"id": "a", "x": 1, "created": "t1"}\n{"id": "b", "x": 2}\n')
    q = tmp_path / "b.jsonl"
    q.write_text('{"id": "b", "x": 2}\n{"id": "a", "x": 1, "created": "t2"}\n')
    assert jsonl_view(p) == jsonl_view(q)
    q.write_text('{"id": "b", "x": 2}\n{"id": "a", "x": 3}\n')
    assert jsonl_view(p) != jsonl_view(q)
    p.write_bytes(p.read_bytes() + b'{"id": "c", "x"')
    with pytest.raises(AssertionError, match="torn last line"):
        strict_jsonl(p)
    p.write_text('{"id": "a"}\n{"id": "a"}\n')
    with pytest.raises(AssertionError, match="duplicate id"):
        jsonl_view(p)


def test_tensor_views_are_bitwise(tmp_path):
    t = torch.linspace(-1, 1, 64).reshape(8, 8)
    save_file({"t": t}, str(tmp_path / "a.safetensors"))
    save_file({"t": t.clone()}, str(tmp_path / "b.safetensors"))
    assert safetensors_view(tmp_path / "a.safetensors") == safetensors_view(tmp_path / "b.safetensors")
    u = t.clone()
    u[3, 3] = torch.nextafter(u[3, 3], torch.tensor(2.0))  # one ulp
    save_file({"t": u}, str(tmp_path / "c.safetensors"))
    assert safetensors_view(tmp_path / "a.safetensors") != safetensors_view(tmp_path / "c.safetensors")


def test_tree_view_fails_on_temp_files_and_hides_the_output_path(tmp_path):
    for name in ("x", "y"):
        d = tmp_path / name
        d.mkdir()
        (d / "manifest.json").write_text(json.dumps({"out": str(d), "pid": 1 if name == "x" else 2, "n": 3}))
    assert tree_view(tmp_path / "x") == tree_view(tmp_path / "y")
    (tmp_path / "y" / ".tmp-data.jsonl").write_text("")
    with pytest.raises(AssertionError, match="temp files left behind"):
        tree_view(tmp_path / "y")


def test_moments_are_seeded_and_cover_start_up_bytes_and_time():
    ref = Reference(Path("."), {}, final_bytes=10_000, startup_s=2.0, work_s=5.0)
    a, b = moments(7, 50, ref), moments(7, 50, ref)
    assert a == b and a != moments(8, 50, ref)
    kinds = {("startup" if m.after_bytes == 0 else "time" if m.after_bytes < 0 else "bytes") for m in a}
    assert kinds == {"startup", "bytes", "time"} and any(m.kills == 2 for m in a)
    assert all(m.after_bytes < 10_000 for m in a)


# A stage that writes its records one by one and a manifest at the end. Resuming, the careless
# version appends everything again (duplicates); the careful one skips committed ids.
TOY = textwrap.dedent("""
    import json, os, sys, time
    out, careful = sys.argv[1], sys.argv[2] == "careful"
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "data.jsonl")
    done = set()
    if careful and os.path.exists(path):
        data = open(path, "rb").read()
        data = data[: data.rfind(b"\\n") + 1]          # cut a torn last line
        open(path, "wb").write(data)
        done = {json.loads(x)["id"] for x in data.splitlines()}
    with open(path, "a") as f:
        for i in range(40):
            if f"r{i}" in done:
                continue
            f.write(json.dumps({"id": f"r{i}", "v": i * i}) + "\\n")
            f.flush()
            time.sleep(0.01)
    json.dump({"complete": True}, open(os.path.join(out, "manifest.json"), "w"))
""")


@pytest.mark.parametrize("careful", [True, False])
def test_a_sweep_passes_a_resumable_stage_and_fails_a_careless_one(careful, tmp_path):
    script = tmp_path / "toy.py"
    script.write_text(TOY)
    spec = StageSpec(str(script), argv=lambda out: [out, "careful" if careful else "careless"],
                     view=lambda out: tree_view(out))
    ref_out = tmp_path / "ref"
    assert spec.run(ref_out).rc == 0
    ref = Reference(ref_out, spec.view(ref_out), final_bytes=(ref_out / "data.jsonl").stat().st_size,
                    startup_s=0.0, work_s=0.4)
    if careful:
        sweep(spec, tmp_path / "trials", ref, seed=0, n=3, mix=(0.0, 1.0, 0.0), byte_range=(0.2, 0.8),
              max_delay_s=0.0)
    else:
        with pytest.raises(AssertionError, match="duplicate id"):
            crash_trial(spec, tmp_path / "trial", moments(0, 1, ref, mix=(0.0, 1.0, 0.0), byte_range=(0.2, 0.8),
                                                          max_delay_s=0.0)[0], ref.view)


def test_a_time_kill_that_finds_the_run_finished_is_drawn_again_earlier(tmp_path):
    """The working window is timed on the reference (the cold first run); a warmer trial can end
    before the drawn moment. Such a trial is retried at half the delay instead of failing the
    sweep with 'too few kills', and without retries it does fail that way."""
    script = tmp_path / "toy.py"
    script.write_text(TOY)
    spec = StageSpec(str(script), argv=lambda out: [out, "careful"], view=lambda out: tree_view(out))
    ref_out = tmp_path / "ref"
    assert spec.run(ref_out).rc == 0
    # The toy works ~0.4 s; a reference that claims 2.4 s puts the kill (at 100 % of the window) long after.
    ref = Reference(ref_out, spec.view(ref_out), final_bytes=(ref_out / "data.jsonl").stat().st_size,
                    startup_s=0.0, work_s=2.4)
    kw = dict(seed=0, n=1, mix=(0.0, 0.0, 1.0), window_range=(1.0, 1.0), double_share=0.0)
    with pytest.raises(AssertionError, match="too few kills"):
        sweep(spec, tmp_path / "no-retry", ref, retries=0, **kw)
    trials = sweep(spec, tmp_path / "retry", ref, retries=4, **kw)
    # drawn again earlier (halved until the kill lands mid-run: how often depends on the machine's load)
    assert trials[0].mid_run == 1 and trials[0].moment.delay_s < ref.work_s
