"""CI smoke test of bench/npu_check.py (the prepared NPU benchmark, never run on an NPU): its
``--device cpu`` mode runs the same parity and timing code on tiny shapes with the ``ascendc-emu``
backend, so the script's own logic is not first tried on an NPU."""

import json
import os
import subprocess
import sys
import time

import pytest

from ascend_moe_ops import _backends

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "npu_check.py")
OPS = ("permute", "unpermute", "grouped_gemm", "flash_attention", "mla_attention")


def test_npu_check_cpu_smoke(tmp_path):
    if "ascendc-emu" not in _backends.available_backends("moe_permute", "cpu"):
        pytest.skip(f"ascendc-emu is not built: {_backends.unavailable_reason('moe_permute', 'ascendc-emu')}")
    out = tmp_path / "npu_check.json"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("ASCEND_MOE_OPS_BACKEND", None)
    t0 = time.time()
    proc = subprocess.run([sys.executable, SCRIPT, "--device", "cpu", "--iters", "1", "--warmup", "0",
                           "--json", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    wall = time.time() - t0
    log = proc.stdout[-6000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, log
    report = json.loads(out.read_text())
    assert report["ok"] and not report["errors"], log
    assert report["limits"]["copy_GBps"] > 0 and report["limits"]["mm_bf16_TFLOPs"] > 0
    for op in OPS:
        rows = [r for r in report["results"] if r["op"] == op]
        assert rows, f"no timing rows for {op}"
        for r in rows:
            assert r["ours_ms"] is not None and r["ours_ms"] > 0, r
            assert r["rate"] > 0 and r["pct_limit"] is not None and r["formula"], r
            assert r["baseline_ms"] is None and "cpu smoke" in r["baseline_error"], r
        checks = [p for p in report["parity"] if p["op"] == op]
        assert checks, f"no parity rows for {op}"
        assert all(p["ok"] for p in checks), [p for p in checks if not p["ok"]]
    cases = {r["case"].split(" ")[-1] for r in report["results"]}
    assert {"fwd", "bwd", "dX", "dW", "fwd+bwd"} <= cases
    assert "speed-up" in proc.stdout and "% limit" in proc.stdout
    print(f"npu_check --device cpu: {wall:.1f} s")


def test_npu_check_baseline_code_with_fake_torch_npu(capsys):
    """The baseline half of the script (never reached in --device cpu mode) with CPU stand-ins for
    the torch_npu ops (tests/_fake_torch_npu.py), in process: every case gets a baseline time, the
    TND attention layout is refused by the fake and the BSND fallback is taken."""
    if "ascendc-emu" not in _backends.available_backends("moe_permute", "cpu"):
        pytest.skip("ascendc-emu is not built")
    import importlib.util
    import _fake_torch_npu
    spec = importlib.util.spec_from_file_location("npu_check_under_test", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    run = mod.Run(mod.parse_args(["--device", "cpu", "--iters", "1", "--warmup", "0", "--skip-parity"]))
    run.npu, run.baseline_note = _fake_torch_npu, ""
    run.go()
    report = run.payload()
    assert report["ok"], report["errors"]
    assert {r["op"] for r in report["results"]} == set(OPS)
    for r in report["results"]:
        assert r["baseline_ms"] is not None and r["speedup"] > 0, r
    assert all("BSND" in r["baseline"] for r in report["results"] if "attention" in r["op"])
    assert "baselines timed:" in capsys.readouterr().out
