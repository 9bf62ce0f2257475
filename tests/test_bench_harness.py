"""The benchmark harness, CLI, report and chart (ascend_moe_ops.benchmark). Nothing here asserts a
speed: the timings are of tiny callables and only their bookkeeping is checked."""

import json
import math
import os
import types
from pathlib import Path

import pytest
import torch

import ascend_moe_ops as amo
from ascend_moe_ops.bench import Row
from ascend_moe_ops.benchmark import chart, cli, report, runner
from ascend_moe_ops.benchmark.rows import evaluate
from ascend_moe_ops.benchmark.timing import Timing, measure, noise_flags, quantum_cluster

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------- timer
def test_measure_reports_spread_and_pins_threads():
    before = torch.get_num_threads()
    t = measure(lambda: torch.ones(64).sum(), min_run_time=0.01, threads=1)
    assert isinstance(t, Timing) and t > 0 and t.iqr >= 0 and t.n >= 3
    assert t.threads == 1 and "blocked_autorange" in t.method
    assert torch.get_num_threads() == before  # restored after the measurement
    assert min(t.times) <= t.median <= max(t.times)


def test_measure_fixed_runs_with_setup_before_each_run():
    calls = {"fn": 0, "setup": 0}

    def fn():
        calls["fn"] += 1

    def setup():
        calls["setup"] += 1

    t = measure(fn, runs=4, warmup=2, setup=setup)
    assert t.n == 4 and len(t.times) == 4
    assert calls["fn"] == 6  # 2 warm-up + 4 timed, nothing else (ranks must agree on the count)
    assert calls["setup"] == 6


def test_measure_reads_the_given_clock():
    """``clock=``: every run is the difference of two reads of that clock (a fake clock that
    advances 0.25 s per read gives runs of exactly 0.25 s); a non-callable or a non-CPU device is
    refused with the argument named."""
    state = {"t": 0.0}

    def fake():
        state["t"] += 0.25
        return state["t"]

    t = measure(lambda: None, runs=5, warmup=1, clock=fake)
    assert t.n == 5 and all(x == pytest.approx(0.25) for x in t.times) and t.median == pytest.approx(0.25)
    with pytest.raises(ValueError, match="clock must be callable"):
        measure(lambda: None, runs=1, clock=3.0)
    with pytest.raises(ValueError, match="clock is for the CPU only"):
        measure(lambda: None, runs=1, clock=fake, device="cuda")


def test_noise_flags():
    sliced = Timing(0.032, 0.0, 6, [0.016, 0.032, 0.032, 0.048, 0.032, 0.0161])
    assert any("16 ms" in f for f in noise_flags(sliced))
    spread = Timing(0.0105, 0.004, 5, [0.0071, 0.0093, 0.0105, 0.0113, 0.0137])
    flags = noise_flags(spread)
    assert any("IQR" in f for f in flags) and not any("cluster" in f for f in flags)
    quiet = Timing(0.0105, 0.0001, 5, [0.01049, 0.0105, 0.01051, 0.0105, 0.0105])
    assert noise_flags(quiet) == []
    assert quantum_cluster([0.0051, 0.0072, 0.0093, 0.0133, 0.0171]) is None


def test_no_hand_written_timer_in_the_tree():
    offenders = []
    for folder in ("ascend_moe_ops", "bench", "triton_ref"):
        for p in (ROOT / folder).rglob("*.py"):
            text = p.read_text()
            if "perf_counter" in text or "time.time()" in text:
                offenders.append(str(p.relative_to(ROOT)))
    assert offenders == []


# ------------------------------------------------------------------------------- CLI errors
def test_list_names_every_op(capsys):
    assert cli.main(["--list"]) == 0
    out = capsys.readouterr().out
    for op in ("moe_permute", "moe_unpermute", "grouped_gemm", "mla_attention", "flash_attention",
               "ep_dispatcher", "balance"):
        assert op in out


def test_unknown_op_is_an_error_listing_the_valid_ones(capsys):
    with pytest.raises(SystemExit) as e:
        cli.parse_args(["--ops", "flash_atention"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "flash_atention" in err and "moe_permute" in err and "flash_attention" in err


def test_alias_resolves_to_its_module():
    assert runner.resolve_ops(["flash_attention", "mla_attention", "moe_unpermute"]) == \
        ["mla_attention", "moe_permute"]


@pytest.mark.parametrize("device", ["cuda", "npu"])
def test_absent_device_is_a_clear_error(device, capsys):
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("a GPU is present")
    if device == "npu" and cli.device_problem("npu") is None:
        pytest.skip("an NPU is present")
    with pytest.raises(SystemExit) as e:
        cli.parse_args(["--device", device])
    assert e.value.code == 2
    assert f"--device {device}" in capsys.readouterr().err


def test_bad_shape_flags(capsys):
    with pytest.raises(SystemExit):
        cli.parse_args(["--experts", "4", "--topk", "8"])
    assert "--topk" in capsys.readouterr().err


def test_shape_flag_is_the_per_dim_flags_in_one():
    a = cli.parse_args(["--shape", "T=4096,H=7680,E=256,K=8"])
    assert a.shape == {"T": 4096, "H": 7680, "E": 256, "K": 8}
    assert cli.parse_args(["--shape", "T=64,H=32", "--tokens", "128"]).shape == {"T": 128, "H": 32}


def test_gemm_shape_flag_parses_and_defaults_to_balanced():
    a = cli.parse_args(["--gemm-shape", "E=32,M=8192,K=2048,N=1408",
                        "--gemm-shape", "E=4, M=100, K=64, N=48, sizes=zipf"])
    assert a.gemm_shapes == [dict(E=32, M=8192, K=2048, N=1408, sizes="balanced"),
                             dict(E=4, M=100, K=64, N=48, sizes="zipf")]
    assert cli.parse_args([]).gemm_shapes == []


@pytest.mark.parametrize("flag,value,needle", [
    ("--gemm-shape", "E=32,M=8192,K=2048", "missing N"),
    ("--gemm-shape", "E=32,M=8192,K=2048,N=0", "N must be >= 1"),
    ("--gemm-shape", "E=32,M=8192,K=2048,N=x", "N must be an integer"),
    ("--gemm-shape", "E=32,M=8192,K=2048,N=8,sizes=uniform", "sizes must be one of balanced, zipf"),
    ("--gemm-shape", "E=32,M=8192,K=2048,N=8,Q=1", "bad item 'Q=1'"),
    ("--gemm-shape", "E=3,E=4,M=8,K=8,N=8", "E given twice"),
    ("--shape", "T=64,N=3", "bad item 'N=3'"),
    ("--shape", "", "--shape: empty"),
    ("--shape", "E=4,K=8", "--topk (8) must be <= --experts (4)"),
])
def test_bad_shape_values_name_the_flag(flag, value, needle, capsys):
    with pytest.raises(SystemExit) as e:
        cli.parse_args([flag, value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert needle in err and flag in err


def test_gemm_cases_from_shapes():
    from ascend_moe_ops.benchmark.suite import bench_grouped_gemm as bg
    got = list(bg.cases(False, [dict(E=5, M=23, K=16, N=8, sizes="balanced"),
                                dict(E=6, M=40, K=16, N=8, sizes="zipf")]))
    assert [c[0] for c in got] == ["balanced E5 M23 K16 N8", "zipf E6 M40 K16 N8"]
    bal, zipf = got[0][5], got[1][5]
    assert bal.tolist() == [5, 5, 5, 4, 4] and int(zipf.sum()) == 40 and len(zipf) == 6
    assert zipf.max() > zipf.min()  # skewed
    names = [c[0] for c in bg.cases(False)]  # the preset's rows keep their names (--compare keys)
    assert names == ["balanced E32 M8192 K2048 N1408", "zipf E32 M8192 K2048 N1408", "fine E256 M16384 K512 N256"]


# ------------------------------------------------------------------------------- a whole run
def _fake_module():
    def run(ctx):
        src = torch.randn(1 << 14)
        dst = torch.empty_like(src)
        a = torch.randn(64, 32)
        b = torch.randn(32, 48)
        t_copy = ctx.time(lambda: dst.copy_(src))
        t_clone = ctx.time(lambda: src.clone())
        t_mm = ctx.time(lambda: torch.mm(a, b))
        return [
            Row(op="fake", case="copy 64 KiB", backend="native", dtype="float32", seconds=t_copy,
                bytes=2 * src.numel() * 4, formula="bytes = 2 * n * 4", peers={"clone": t_clone},
                path="copy path"),
            Row(op="fake", case="mm 64x32x48", backend="native", dtype="float32", seconds=t_mm,
                flops=2 * 64 * 32 * 48, formula="flops = 2*M*K*N", limit="flops", mm_shape=(64, 32, 48),
                path="mm path"),
            Row(op="fake", case="link", backend="flat", dtype="float32", seconds=t_copy, bytes=1 << 20,
                limit="link", extra={"link_GBps": 0.125}),
        ]
    return types.SimpleNamespace(run=run, PYTEST_CASES=True)


@pytest.fixture
def fake_suite(monkeypatch):
    mod = _fake_module()
    monkeypatch.setattr(runner, "load", lambda name: mod)
    monkeypatch.setattr(cli, "resolve_ops", lambda names: ["fake"])
    monkeypatch.setattr(runner, "resolve_ops", lambda names: ["fake"])
    return mod


def test_cli_run_writes_json_png_and_compares(fake_suite, tmp_path, capsys):
    out = tmp_path / "res"
    rc = cli.main(["--ops", "fake", "--min-run-time", "0.01", "--threads", "1", "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "% copy (same WS)" in text and "% dense mm" in text and "% link" in text and "IQR" in text
    js = list(out.glob("bench-*.json"))
    png = list(out.glob("bench-*.png"))
    assert len(js) == 1 and len(png) == 1 and png[0].stat().st_size > 10_000
    d = json.loads(js[0].read_text())
    env = d["environment"]
    assert env["version"] == amo.__version__ and env["torch"] == torch.__version__
    assert env["threads"] == 1 and env["cpu"] and "compilers" in env and "git_commit" in env
    kinds = {m["kind"] for m in d["limits"]["measured"]}
    assert {"copy", "alloc-copy", "dense mm"} <= kinds
    rows = {r["case"]: r for r in d["rows"]}
    c = rows["copy 64 KiB"]
    assert c["median_s"] > 0 and c["iqr_s"] >= 0 and c["n"] >= 3 and c["formula"] and c["path"] == "copy path"
    assert c["pct_copy"] > 0 and c["residency"] in ("cache", "DRAM", "unknown") and c["pct_mm"] is None
    assert c["peers"]["clone"]["speedup"] > 0
    copy_lim = [m for m in d["limits"]["measured"] if m["kind"] == "copy"][0]
    assert abs(copy_lim["working_set_bytes"] - c["bytes"]) / c["bytes"] < 0.05  # same working set
    m = rows["mm 64x32x48"]
    assert m["pct_mm"] > 0 and m["pct_copy"] is None and "64x32x48" in m["limit_note"]
    assert [x for x in d["limits"]["measured"] if x["kind"] == "dense mm"][0]["shape"] == [64, 32, 48]
    assert rows["link"]["pct_link"] > 0 and rows["link"]["pct_copy"] is None

    # --compare: against itself -> 0; against a baseline 100x faster -> exit 3
    base = json.loads(js[0].read_text())
    for r in base["rows"]:
        r["median_s"] /= 100
    fast = tmp_path / "fast.json"
    fast.write_text(json.dumps(base))
    assert cli.main(["--min-run-time", "0.01", "--out", str(out), "--compare", str(js[0]),
                     "--threshold", "100"]) == 0
    assert cli.main(["--min-run-time", "0.01", "--out", str(out), "--compare", str(fast)]) == 3
    assert "SLOWER" in capsys.readouterr().out


def test_gemm_shapes_reach_the_bench_module(fake_suite, tmp_path):
    seen = []
    fake_suite.run = lambda ctx: seen.append(ctx.gemm_shapes) or []
    out = tmp_path / "res"
    assert cli.main(["--no-parity", "--out", str(out), "--gemm-shape", "E=2,M=8,K=4,N=4,sizes=zipf"]) == 0
    assert seen == [[dict(E=2, M=8, K=4, N=4, sizes="zipf")]]
    d = json.loads(next(out.glob("bench-*.json")).read_text())
    assert d["gemm_shapes"] == seen[0]


def test_default_out_is_cwd_amo_bench(fake_suite, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["--min-run-time", "0.01", "--no-parity"]) == 0
    assert list((tmp_path / "amo-bench").glob("bench-*.json"))


def test_collect_cases_names_rows_and_replays_the_backend(fake_suite):
    seen = []
    mod = fake_suite

    def run(ctx):
        with amo.use_backend("reference"):
            t = ctx.time(lambda: seen.append(runner.forced_backend()))
        return [Row(op="x", case="c", backend="reference", dtype="fp32", seconds=t, limit="none")]

    mod.run = run
    cases = runner.collect_cases(ops=["fake"])
    assert [c.id for c in cases] == ["x[c][reference]"] and not seen  # nothing ran at collection
    cases[0].fn()
    assert seen == ["reference"]


# ------------------------------------------------------------------------------- chart
def test_chart_renders_panels_with_an_outlier(tmp_path):
    recs = []
    for i, (pc, mm) in enumerate([(95, None), (445, None), (None, 88), (None, 101)]):
        recs.append(dict(op="op", case=f"case {i} with a rather long label to see that it is not clipped",
                         backend="native", pct_copy=pc, pct_mm=mm, pct_link=None,
                         peers={"peer": {"speedup": 1.5 + i}}))
    path = tmp_path / "c.png"
    assert chart.render(recs, path, "test") is None
    import matplotlib.image
    img = matplotlib.image.imread(str(path))
    h, w = img.shape[:2]
    assert 1000 < w < 2000 and 300 < h < 3000 and path.stat().st_size > 10_000
    assert chart._axis_cap([95, 445, 90, 97], 100) < 445  # the outlier is cut, not scaled to


def test_chart_title_clears_the_first_panel():
    """The title must sit above the top panel's first row labels and inside the figure (the default
    suptitle, at 98 % of the height, fell on them in tall charts)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    for n in (1, 4, 40, 150):  # figure heights from about 2 to 40 inches (the quick preset: 38)
        recs = [dict(op="moe_permute", case=f"fwd T4096 H7680 E256 K8 balanced row {i}", backend="native",
                     pct_copy=80.0 + i, pct_mm=None, pct_link=None, peers={}) for i in range(n)]
        fig = chart.figure(recs, "ascend_moe_ops 0.1.0 on a CPU model name (2 threads), preset quick, a date")
        try:
            fig.canvas.draw()
            r = fig.canvas.get_renderer()
            title = fig._suptitle.get_window_extent(r)
            first = fig.axes[0].get_tightbbox(r)  # the axes with its tick labels
            assert title.y0 >= first.y1 - 0.5, (n, title, first)
            assert title.y1 <= fig.bbox.y1 + 0.5, (n, title, fig.bbox)
        finally:
            plt.close(fig)


def test_chart_without_rates_or_peers_says_why(tmp_path):
    recs = [dict(op="op", case="c", backend="native", pct_copy=None, pct_mm=None, pct_link=None, peers={})]
    assert chart.figure(recs, "t") is None
    assert chart.render(recs, tmp_path / "c.png", "t") == "no chart: no rows with a rate or a peer"
    assert not (tmp_path / "c.png").exists()


def test_compare_matches_rows_by_key(tmp_path):
    base = tmp_path / "b.json"
    base.write_text(json.dumps({"rows": [{"key": "a | b | c", "median_s": 1.0},
                                         {"key": "gone", "median_s": 1.0}]}))
    text, reg = report.compare([{"key": "a | b | c", "median_s": 1.25}], str(base), 0.1)
    assert len(reg) == 1 and "1.250" in text and "1 baseline rows not in this run" in text
    _, reg = report.compare([{"key": "a | b | c", "median_s": 1.05}], str(base), 0.1)
    assert reg == []


# ------------------------------------------------------------------------------- packaging names
def test_namespaced_subpackages_resolve():
    import importlib
    tr = importlib.import_module("ascend_moe_ops.triton_ref")
    suite = importlib.import_module("ascend_moe_ops.benchmark.suite")
    assert Path(tr.__file__).parent.name == "triton_ref"
    assert (Path(suite.__file__).parent / "bench_moe_permute.py").is_file()
    assert "bench_grouped_gemm.py" in os.listdir(runner.suite_dir())


def test_limit_now_measures_next_to_the_row_and_is_reused():
    from ascend_moe_ops.benchmark.rows import evaluate
    ctx = runner.Context("cpu", min_run_time=0.01)
    ctx.limit_now(nbytes=1 << 16, mm_shape=(32, 32, 32), dtype=torch.float32)
    assert [m["kind"] for m in ctx.machine.measured] == ["copy", "alloc-copy", "dense mm"]
    t = Timing(1e-4, 0.0, 3, [1e-4] * 3)
    evaluate(Row(op="a", case="b", backend="c", dtype="float32", seconds=t, bytes=1 << 16), ctx.machine)
    evaluate(Row(op="a", case="m", backend="c", dtype="float32", seconds=t, flops=2 * 32 ** 3,
                 limit="flops", mm_shape=(32, 32, 32)), ctx.machine)
    assert len(ctx.machine.measured) == 3  # the rows reuse the limits measured next to them
    rec = runner.Context("cpu", recording=True)
    rec.limit_now(nbytes=1 << 16)
    assert rec.machine.measured == []


def test_time_vs_copy_alternates_and_compares_round_by_round():
    from ascend_moe_ops.benchmark.rows import evaluate
    ctx = runner.Context("cpu", min_run_time=0.01)
    calls = []
    src = torch.randn(1 << 13)
    dst = torch.empty_like(src)

    def op():
        calls.append(1)
        dst.copy_(src)

    t = ctx.time_vs_copy(op, nbytes=1 << 16, rounds=4)
    assert len(t.copy_pairs) == 4 and all(a > 0 and b > 0 for a, b in t.copy_pairs)
    assert t.n == len(t.times) >= 4 and len(calls) >= t.n
    assert t.copy_bytes == 1 << 16
    assert [m["kind"] for m in ctx.machine.measured] == ["copy (alternated with a row)"]
    assert len(ctx.machine.measured[0]["GBps_per_round"]) == 4
    # the % copy column is the median of the per-round ratios, not the ratio to a once-timed copy
    fake = Timing(2e-3, 0.0, 3, [2e-3] * 3)
    fake.copy_pairs = [(2e-3, 1e-3), (2e-3, 2e-3), (1e-3, 3e-3)]
    fake.copy_bytes = 1 << 20
    ev = evaluate(Row(op="a", case="b", backend="c", dtype="float32", seconds=fake,
                      bytes=1 << 20), ctx.machine)
    assert ev["pct_copy_rounds"] == [50.0, 100.0, 300.0]
    assert ev["pct_copy"] == pytest.approx(100.0)
    assert "3 rounds, 50-300 %" in ev["limit_note"]
    assert all(m["kind"] != "copy" for m in ctx.machine.measured)   # no once-timed copy needed
    rec = runner.Context("cpu", recording=True)                    # pytest collection: no copy
    assert math.isnan(rec.time_vs_copy(op, nbytes=1 << 16)) and rec.machine.measured == []


class _FixedMachine:
    """Limits with known values: dense mm 2 TFLOP/s, copy 10 GB/s."""

    def mm_tflops_for(self, M, K, N, dtype):
        return 2.0

    def mm_tflops(self, dtype):
        return 2.0

    def copy_gbps_for(self, nbytes, fresh=False):
        return 10.0


@pytest.mark.parametrize("flops, nbytes, bound, pct", [
    (4e12, 1e9, "compute", 50.0),   # 2 s of compute, 0.1 s of memory, ran in 4 s
    (4e10, 2e10, "memory", 50.0),   # 0.02 s of compute, 2 s of memory, ran in 4 s
])
def test_roofline_is_the_slower_of_compute_and_memory(flops, nbytes, bound, pct):
    row = Row(op="gg", case="c", backend="native", dtype="bfloat16", seconds=4.0, flops=int(flops),
              bytes=int(nbytes), limit="flops", mm_shape=(8, 8, 8))
    ev = evaluate(row, _FixedMachine())
    assert ev["roofline_bound"] == bound and ev["pct_roofline"] == pytest.approx(pct)
    assert ev["pct_mm"] == pytest.approx(100 * flops / 4.0 / 2e12)
    no_bytes = evaluate(Row(op="gg", case="c", backend="native", dtype="bfloat16", seconds=4.0,
                            flops=int(flops), limit="flops", mm_shape=(8, 8, 8)), _FixedMachine())
    assert no_bytes["pct_roofline"] is None and no_bytes["roofline_bound"] is None


@pytest.mark.parametrize("flag, value, why", [
    ("--min-run-time", "nan", "finite"), ("--min-run-time", "inf", "finite"),
    ("--min-run-time", "-1", "> 0"), ("--min-run-time", "0", "> 0"),
    ("--threshold", "nan", "finite"), ("--threshold", "-0.1", ">= 0"),
    ("--threads", "0", ">= 1"), ("--tokens", "-3", ">= 1"), ("--topk", "x", "integer"),
])
def test_bad_numeric_flag_is_an_argparse_error(flag, value, why, capsys):
    # nan used to reach blocked_autorange(nan) and hang; -1 was accepted silently
    with pytest.raises(SystemExit) as e:
        cli.main(["--ops", "moe_permute", "--no-parity", "--shape", "T=4", flag, value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}:" in err and why in err


def test_unknown_backend_is_an_error_listing_the_valid_ones(capsys):
    # it used to write a JSON with no rows and exit 0
    with pytest.raises(SystemExit) as e:
        cli.main(["--ops", "moe_permute", "--backend", "nosuch"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--backend" in err and "'nosuch'" in err
    for name in amo._backends.BACKENDS:
        assert name in err
    assert cli.parse_args(["--backend", "native", "reference"]).backend == ["native", "reference"]
