"""The Atlas A2 timeline model (ascend_moe_ops/perfmodel/a2_timeline.py) pinned on cases whose answer
is known analytically, with the small kernels of tests/cpp/emu_timeline_driver.cpp (recorded by the
emulator's pipe model, csrc/ascend/emu/timeline.h): a pure copy costs bytes / HBM bandwidth, a chain
of Mmads FLOPs / Cube peak, a double-buffered load -> vector -> store pipeline the max of its stages
and a single-buffered one their sum; a missing flag is rejected (never modelled faster), a redundant
one changes nothing, an extra barrier never speeds a kernel up. Then the real AscendC kernels at small
shapes through the emulated backend. Every time here is a MODEL of A2, not a measurement."""

import json
import os

import pytest
import torch

from _ascend_cxx import driver_fixture, run_case
from ascend_moe_ops.perfmodel import a2_timeline as tl
from ascend_moe_ops.perfmodel import load_table

A2 = load_table("a2")
HZ = A2["clock_hz"]


driver = driver_fixture("emu_timeline_driver")


_cache = {}


def launch(driver, case):
    if case not in _cache:
        out = run_case(driver, case, timeout=300)
        assert not out.startswith("EmuError"), out
        launches = tl.load_recording(out)
        assert len(launches) == 1
        _cache[case] = launches[0]
    return _cache[case]


def makespan(m, table=A2):
    return m.predicted_s - table["launch_latency_s"]


# latencies that are not part of the stage arithmetic, made negligible (x 1e-9)
NO_LATENCY = {"dma_latency_cycles": 1e-9, "flag_latency_cycles": 1e-9, "issue_cycles": 1e-9}


def test_table_has_the_chip_level_keys_the_step_simulator_reads():
    for key in ("cube_cores", "vector_cores", "clock_hz", "cube_macs_per_cycle_fp16", "gm_bandwidth",
                "hbm_capacity"):
        assert A2[key] > 0, key
    assert A2["vector_cores"] == 2 * A2["cube_cores"]  # one AIC and two AIVs per AI Core
    # the peak the roofline uses: cores x 16^3 MACs x 2 x clock
    assert tl.peak_flops(A2) == pytest.approx(A2["cube_cores"] * 4096 * 2 * HZ)


def test_copy_costs_bytes_over_bandwidth(driver):
    rec = launch(driver, "copy")
    assert rec["kind"] == "vector" and len(rec["cores"]) == 48
    m = tl.simulate(rec)
    nbytes = 2 * 48 * 256 * 1024 * 4  # read + written
    assert m.gm_bytes == nbytes
    expect = nbytes / A2["gm_bandwidth"]
    # every byte crosses HBM once (the few source lines that share an L2 line with a line already
    # present hit); the copied lines are still dirty at the end and count too
    assert 0.99 * nbytes <= m.hbm_bytes <= nbytes and m.l2_dirty_end_bytes == nbytes // 2
    assert m.hbm_bytes / A2["gm_bandwidth"] <= makespan(m) <= 1.05 * expect, (makespan(m), expect)
    assert m.bound == "HBM bandwidth"
    # bandwidth-bound: half the bandwidth, twice the time
    half = A2.scaled({"gm_bandwidth": 0.5})
    assert makespan(tl.simulate(rec, half), half) == pytest.approx(2 * makespan(m), rel=0.05)


def test_mmad_chain_costs_flops_over_peak(driver):
    rec = launch(driver, "mmad_chain")
    assert rec["kind"] == "cube" and len(rec["cores"]) == 24
    m = tl.simulate(rec)
    assert m.flops == 24 * 200 * 2 * 128 ** 3
    expect = m.flops / tl.peak_flops(A2)
    assert expect <= makespan(m) <= 1.08 * expect, (makespan(m), expect)
    assert m.bound == "Cube (M)" and m.busy["M"] > 0.9
    fast = A2.scaled({"cube_macs_per_cycle_fp16": 2.0})
    assert makespan(tl.simulate(rec, fast), fast) == pytest.approx(makespan(m) / 2, rel=0.08)


def _stages(table):
    tile = 4096 * 4
    load = (table["dma_instr_cycles"] + tile / table["mte2_gm_bytes_per_cycle"]) / HZ
    vec = (table["vector_instr_cycles"] + tile / table["vector_bytes_per_cycle"]) / HZ
    store = (table["dma_instr_cycles"] + tile / table["mte3_gm_bytes_per_cycle"]) / HZ
    return load, vec, store


def test_double_buffering_costs_the_max_of_its_stages(driver):
    t = A2.scaled(NO_LATENCY)
    load, vec, store = _stages(t)
    assert load > vec + store / 2  # the load is the longest stage and two buffers hide the others
    m = tl.simulate(launch(driver, "pipe_double"), t)
    assert makespan(m, t) == pytest.approx(64 * max(load, vec, store), rel=0.05)
    assert m.busy["MTE2"] > 0.9


def test_single_buffering_costs_the_sum_of_its_stages(driver):
    t = A2.scaled(NO_LATENCY)
    m = tl.simulate(launch(driver, "pipe_single"), t)
    assert makespan(m, t) == pytest.approx(64 * sum(_stages(t)), rel=0.02)
    # and double buffering is the faster one, with or without the latencies
    for table in (t, A2):
        assert tl.simulate(launch(driver, "pipe_double"), table).predicted_s < \
            tl.simulate(launch(driver, "pipe_single"), table).predicted_s


def test_pipe_floor_is_the_busiest_pipe_and_bounds_every_schedule(driver):
    """The ceiling: launch latency + the busiest pipe's least work. Single buffering takes the sum of
    its stages, but its busiest pipe (the load) is the max: the ceiling says buffering alone could
    win sum / max; double buffering already sits on it; a Mmad chain is its Cube time."""
    t = A2.scaled(NO_LATENCY)
    load, vec, store = _stages(t)
    single = tl.simulate(launch(driver, "pipe_single"), t)
    assert single.floor_s - t["launch_latency_s"] == pytest.approx(64 * load, rel=0.02)
    assert single.busiest_pipe.startswith("MTE2 of AIV block")
    # every stage its own floor; one core's work per pipe is the same on every core here
    for pipe, stage in (("MTE2", load), ("V", vec), ("MTE3", store)):
        hi, mean = single.pipe_floors[pipe]
        assert hi == pytest.approx(64 * stage, rel=0.02) and mean == pytest.approx(hi, rel=1e-6), pipe
    assert "M" not in single.pipe_floors  # a vector kernel has no Cube
    assert single.pct_ceiling == pytest.approx(single.pct_roofline * single.predicted_s / single.floor_s)
    # what buffering alone could win: the sum of the stages over their max
    assert makespan(single, t) / (single.floor_s - t["launch_latency_s"]) == \
        pytest.approx((load + vec + store) / load, rel=0.03)
    double = tl.simulate(launch(driver, "pipe_double"), t)
    assert double.floor_s == pytest.approx(double.predicted_s, rel=0.05)
    chain = tl.simulate(launch(driver, "mmad_chain"))
    assert chain.busiest_pipe.startswith("M of AIC block")
    assert chain.floor_s - A2["launch_latency_s"] == pytest.approx(chain.flops / tl.peak_flops(A2), rel=0.08)
    for case in ("copy", "mmad_chain", "pipe_double", "pipe_single"):
        for table in (A2, t, A2.scaled({"gm_bandwidth": 0.3, "l2_read_bytes_per_cycle": 0.5})):
            m = tl.simulate(launch(driver, case), table)
            assert 0 < m.floor_s <= m.predicted_s * (1 + 1e-12), (case, m.floor_s, m.predicted_s)
            assert m.pct_roofline <= m.pct_ceiling <= 100


def test_a_repeat_form_vector_instruction_costs_its_iterations_not_its_span(driver):
    """The vector unit runs a repeat-form instruction as repeatTimes iterations of 256 B (API reference,
    repeatTimes), whatever its strides and mask: two 64-column halves of a 64 x 128 fp32 tile cost what
    the whole tile costs in the count form, and a one-block mask costs a whole iteration per repeat.
    (Charging the span of the strided operands, as the model did before, doubled the halves' cost.)"""
    rec = launch(driver, "vec_repeat")
    names = rec["names"]
    local = {}
    for r in rec["cores"][0]["recs"]:
        if r[0] == tl.V:
            local[names[r[1]]] = local.get(names[r[1]], 0) + r[5]
    assert local["Add"] == 2 * 64 * 256        # 2 instructions x 64 repeats x 256 B
    assert local["Sub"] == 64 * 128 * 4        # the count form: the tile's bytes
    assert local["Add"] == local["Sub"]
    assert local["Mul"] == 64 * 256            # 64 repeats, 32 B each touched: 64 iterations
    m = tl.simulate(rec)
    assert m.busy["V"] > 0


def test_a_missing_flag_is_rejected_not_modelled_faster(driver):
    out = run_case(driver, "pipe_missing_flag")
    assert out.startswith("EmuError") and "missing sync MTE2->V" in out, out


def test_a_redundant_flag_changes_nothing_and_an_extra_barrier_never_helps(driver):
    for table in (A2, A2.scaled(NO_LATENCY)):
        single = tl.simulate(launch(driver, "pipe_single"), table).predicted_s
        redundant = tl.simulate(launch(driver, "pipe_single_redundant"), table).predicted_s
        assert redundant == pytest.approx(single, rel=1e-9)
        double = tl.simulate(launch(driver, "pipe_double"), table).predicted_s
        barrier = tl.simulate(launch(driver, "pipe_double_barrier"), table).predicted_s
        assert barrier >= double * 1.2  # the barrier serializes the pipes again


def test_longer_latencies_never_speed_a_kernel_up(driver):
    for case in ("copy", "pipe_double", "pipe_single"):
        base = tl.simulate(launch(driver, case)).predicted_s
        for key in ("dma_latency_cycles", "flag_latency_cycles", "dma_instr_cycles", "vector_instr_cycles"):
            slow = A2.scaled({key: 1.3})
            assert tl.simulate(launch(driver, case), slow).predicted_s >= base * (1 - 1e-9), (case, key)


def test_perfetto_trace(driver, tmp_path):
    m = tl.simulate(launch(driver, "pipe_double"), trace=True)
    path = tmp_path / "pipe_double.json"
    tl.write_trace(str(path), m)
    tr = json.loads(path.read_text())
    xs = [e for e in tr["traceEvents"] if e["ph"] == "X"]
    # the stores' lines are still dirty at the end; the HBM, idle most of the run, carries them without
    # extending it (no write-back slice)
    assert m.l2_dirty_end_bytes > 0 and m.l2_flush_s == 0
    assert {e["name"] for e in xs} == {"DataCopy (GM->UB)", "Muls", "DataCopy (UB->GM)"}
    assert "model" in tr["metadata"]["model"] and not tr["metadata"]["truncated"]
    names = {e["args"]["name"] for e in tr["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {"MTE2", "V", "MTE3"} <= names
    # one pipe runs one instruction at a time
    for tid in {e["tid"] for e in xs}:
        ev = sorted((e for e in xs if e["tid"] == tid), key=lambda e: e["ts"])
        for a, b in zip(ev, ev[1:]):
            assert a["ts"] + a["dur"] <= b["ts"] + 1e-6
    # the schedule ends when the last store's data has landed: its busy end + the DMA latency
    last = max(e["ts"] + e["dur"] for e in xs)
    assert last + A2["dma_latency_cycles"] / HZ * 1e6 == pytest.approx(makespan(m) * 1e6, rel=1e-6)
    with pytest.raises(ValueError, match="trace=True"):
        tl.write_trace(str(path), tl.simulate(launch(driver, "pipe_double")))


# ---- the real kernels through the emulated backend ------------------------------------------------------

emu = pytest.importorskip("ascend_moe_ops._ascendc_emu", reason="the emulated AscendC kernels are not built")
OPS = torch.ops.ascend_moe_ops_emu


def test_recording_is_off_unless_asked():
    x = torch.randn(16, 64, dtype=torch.bfloat16)
    idx = torch.randint(0, 4, (16, 2), dtype=torch.int32)
    OPS.moe_permute(x, idx, None, 4, None, 1, None)
    assert json.loads(emu._timeline_take())["launches"] == []


def test_permute_and_unpermute_record_and_schedule():
    T, H, E, K = 64, 256, 8, 2
    x = torch.randn(T, H, dtype=torch.bfloat16)
    idx = torch.stack([torch.randperm(E)[:K] for _ in range(T)]).to(torch.int32)
    with tl.recording() as launches:
        perm, _, row_map, _, _ = OPS.moe_permute(x, idx, None, E, None, 1, None)
        OPS.moe_unpermute(perm, row_map, None)
    kernels = [l["kernel"] for l in launches]
    assert kernels == ["amo_moe_permute", "amo_moe_unpermute"], kernels
    for l in tl.model_launches(launches):
        assert l.gm_bytes >= 2 * T * K * H  # every permuted row read or written once, at least
        assert 0 < l.predicted_s and 0 < l.pct_roofline <= 100
        assert "model" in l.label and l.table_version == A2.version


def test_grouped_gemm_and_flash_attention_record_and_schedule():
    M, K, N, E = 96, 64, 80, 3
    x = torch.randn(M, K, dtype=torch.bfloat16)
    w = torch.randn(E, K, N, dtype=torch.bfloat16)
    gs = torch.tensor([40, 0, 56])
    q = torch.randn(128, 2, 64, dtype=torch.bfloat16)
    kv = torch.randn(128, 2, 64, dtype=torch.bfloat16)
    cu = torch.tensor([0, 128], dtype=torch.int32)
    with tl.recording() as launches:
        y = OPS.grouped_gemm(x, w, gs, False)
        OPS.grouped_gemm_dw(x, y, gs)
        out, lse = OPS.flash_attention_fwd(q, kv, kv, None, cu, cu, 128, 128, True, 0.125)
        OPS.flash_attention_bwd(out, q, kv, kv, None, out, lse, cu, cu, 128, 128, True, 0.125)
    kinds = {l["kind"] for l in launches}
    assert "cube" in kinds and "mix" in kinds, kinds
    models = tl.model_launches(launches)
    gemm = models[0]
    assert gemm.flops == 2 * 96 * K * N  # the useful FLOPs of the recorded Mmads
    mix = [m for m, l in zip(models, launches) if l["kind"] == "mix"]
    assert mix and all(m.predicted_s > 0 for m in mix)
    for m in models:  # no schedule beats its busiest pipe
        assert 0 < m.floor_s <= m.predicted_s and m.pct_roofline <= m.pct_ceiling <= 100, m.summary()
    # the fused attention kernels hand tiles between AIC and AIV with cross-core flags
    recs = [r for l in launches if l["kind"] == "mix" for c in l["cores"] for r in c["recs"]]
    assert any(r[0] == tl.SET for r in recs) and any(r[0] == tl.WAIT for r in recs)


def test_a2_bench_case_roofline_and_sensitivity():
    """The 'A2 (model)' table's machinery on a small permute: % of the op's own roofline, the
    regime, and a sensitivity row per (parameter, factor)."""
    from ascend_moe_ops.perfmodel import a2_bench as ab
    T, H, E, K = 64, 512, 8, 2
    x = torch.randn(T, H, dtype=torch.bfloat16)
    idx = torch.stack([torch.randperm(E)[:K] for _ in range(T)]).to(torch.int32)
    nbytes = (T * H + T * K * H) * 2
    case = ab.Case("moe_permute", "small", lambda: OPS.moe_permute(x, idx, None, E, None, 1, None), 0, nbytes, "bytes")
    launches = ab.record_case(case)
    m = ab.model_case(case, launches, A2)
    assert m.regime == "HBM bandwidth" and m.kernels == ["amo_moe_permute"]
    assert m.pct_roofline == pytest.approx(100 * nbytes / A2["gm_bandwidth"] / m.predicted_s)
    assert m.pct_roofline <= m.pct_ceiling <= 100 and m.busiest_pipe and m.to_json()["pct_ceiling"] == m.pct_ceiling
    hi, mean = max(m.pipe_floors.values())
    assert hi == pytest.approx(m.floor_s) and mean <= hi  # one launch: its busiest pipe is the floor
    assert "MTE3" in ab.format_pipe_floors([m]) and "pipe floors (model)" in ab.format_pipe_floors([m])
    assert "MODEL" in ab.format_table([m]) and "A2 (model) us" in ab.format_table([m])
    rows = ab.sensitivity([(case, launches, m)], A2, keys=["gm_bandwidth", "launch_latency_s"])
    assert [(k, f) for k, f, _ in rows] == [("gm_bandwidth", 0.7), ("gm_bandwidth", 1.3),
                                            ("launch_latency_s", 0.7), ("launch_latency_s", 1.3)]
    assert "parameter" in ab.format_sensitivity(rows)


def test_a2_bench_a_backward_case_alone_records_only_its_own_launches():
    """``--ops moe_unpermute`` or ``--ops "flash_attention bwd"`` alone: the forward that makes their
    inputs runs unrecorded (its launch had been modelled into the backward's time)."""
    from ascend_moe_ops.perfmodel import a2_bench as ab
    by_op = {c.op: c for c in ab.cases("quick")}
    kernels = {op: {l["kernel"] for l in ab.record_case(by_op[op])} for op in ("moe_unpermute", "flash_attention bwd")}
    assert kernels["moe_unpermute"] == {"amo_moe_unpermute"}
    assert kernels["flash_attention bwd"] and not any(k.startswith("amo_fa_") for k in kernels["flash_attention bwd"])


def test_bench_cli_a2_model_says_when_a_preset_has_no_cases(capsys):
    from ascend_moe_ops.benchmark.cli import _a2_model
    assert _a2_model("deepseek-v3") is None
    assert "no AscendC kernel cases for preset 'deepseek-v3'" in capsys.readouterr().out


# ---- the L2 model, on synthetic recordings with a known answer ------------------------------------------

def _dma_launch(cores, passes, nbytes, base=1 << 32, write_back=False):
    """``cores`` AIVs, each reading its own ``nbytes`` of GM ``passes`` times (one MTE2 DataCopy per
    pass, in pipe order) and, with ``write_back``, writing it once (MTE3) after the last read."""
    names = ["DataCopy GM->UB", "DataCopy UB->GM"]
    out = []
    for b in range(cores):
        addr = base + b * (nbytes + 4096)
        recs, gmr = [], []
        for k in range(passes):
            recs.append([tl.MTE2, 0, 1, k + 1, nbytes, nbytes, 0, 0, 0] + [0] * 7)
            gmr.append([k, addr, nbytes, 0, 1, 0])
        if write_back:
            clock = [0] * 7
            clock[tl.MTE2] = passes
            recs.append([tl.MTE3, 1, 1, 1, nbytes, nbytes, 0, 0, 0] + clock)
            gmr.append([passes, addr + (1 << 30), nbytes, 0, 1, 1])
        out.append({"type": "aiv", "block": b, "recs": recs, "cross": [], "gmr": gmr})
    return {"kernel": "synthetic", "kind": "vector", "block_dim": cores, "names": names, "cores": out}


def test_table_l2_parameters_cite_the_platform_file():
    for key in ("l2_bytes", "l2_read_bytes_per_cycle", "l2_write_bytes_per_cycle"):
        assert "Ascend910B2C.ini" in A2.params[key].source, key
    assert A2["l2_bytes"] == 192 * 2 ** 20 and A2["l2_read_bytes_per_cycle"] == 110
    assert A2["l2_write_bytes_per_cycle"] == 86
    # the write-back L2's public source
    raw = json.load(open(os.path.join(os.path.dirname(tl.__file__), "hardware", "a2.json")))
    assert "L2 CacheMode" in raw["params"]["l2_write_bytes_per_cycle"]["note"]
    assert A2.params["l2_line_bytes"].assumption  # not published: marked as an assumption


def test_l2_lru_known_answers():
    l2 = tl.L2Cache(4 * 128, 128)
    assert l2.access([(0, 512, 0, 1, 0)]) == (0, 512, 0, 0)      # cold: every byte misses
    assert l2.access([(0, 512, 0, 1, 0)]) == (512, 0, 0, 0)      # a re-read of what fits hits
    assert l2.access([(64, 100, 0, 1, 0)]) == (100, 0, 0, 0)     # parts of lines 0, 1: only those bytes
    assert l2.access([(512, 128, 0, 1, 1)]) == (0, 0, 128, 0)    # a write allocates, evicting line 2 (LRU, clean)
    assert l2.access([(256, 128, 0, 1, 0)]) == (0, 128, 0, 0)    # the least recently used line left
    assert l2.access([(0, 256, 0, 1, 0)]) == (256, 0, 0, 0)      # lines 0, 1 stayed
    # a strided run: 3 rows of 64 B, 1 KiB apart; its 3 lines evict lines 4 (the written one: its 128
    # dirty bytes go to HBM), 2 and 0
    assert l2.access([(4096, 64, 1024, 3, 0)]) == (0, 192, 0, 128)
    assert l2.access([(4096, 64, 1024, 3, 0)]) == (192, 0, 0, 0)


def test_l2_partly_held_lines_hit_only_for_their_bytes():
    """A line keeps the mask of the bytes it holds: a read of a line's other bytes misses for them
    (a tile whose rows start off a 128-B boundary shares lines with the next tile: those bytes were
    never fetched), and a re-read of the whole line then hits."""
    l2 = tl.L2Cache(4 * 128, 128)
    assert l2.access([(0, 64, 0, 1, 0)]) == (0, 64, 0, 0)
    assert l2.access([(64, 64, 0, 1, 0)]) == (0, 64, 0, 0)       # same line, other bytes: fetched now
    assert l2.access([(0, 128, 0, 1, 0)]) == (128, 0, 0, 0)
    assert l2.access([(200, 40, 0, 1, 1)]) == (0, 0, 40, 0)       # written bytes are held
    assert l2.access([(128, 128, 0, 1, 0)]) == (40, 88, 0, 0)     # the rest of that line is fetched
    # two 256-B tiles of a row starting 64 B into a line: the line they share is fetched in two halves
    a, b = l2.access([(1024 + 64, 256, 0, 1, 0)]), l2.access([(1024 + 320, 256, 0, 1, 0)])
    assert a == (0, 256, 0, 0) and b == (0, 256, 0, 40)  # b's new lines evict line 1: its 40 dirty bytes


def test_l2_write_back_known_answers():
    l2 = tl.L2Cache(4 * 128, 128)
    assert l2.access([(0, 128, 0, 1, 1)]) == (0, 0, 128, 0)       # line 0 written: dirty, nothing to HBM yet
    for _ in range(5):                                             # rewritten: still one dirty line
        assert l2.access([(0, 128, 0, 1, 1)]) == (0, 0, 128, 0)
    assert l2.dirty_bytes() == 128
    assert l2.access([(0, 128, 0, 1, 0)]) == (128, 0, 0, 0)       # a read of a written line hits
    assert l2.access([(128, 40, 0, 1, 1)]) == (0, 0, 40, 0)       # a partial write: 40 dirty bytes
    assert l2.access([(160, 30, 0, 1, 1)]) == (0, 0, 30, 0)       # overlapping by 8: union 62 bytes
    assert l2.dirty_bytes() == 128 + 62
    # lines 2, 3 read (clean); a fifth line evicts the LRU, line 0: its 128 dirty bytes go to HBM
    assert l2.access([(256, 256, 0, 1, 0)]) == (0, 256, 0, 0)
    assert l2.access([(1024, 128, 0, 1, 0)]) == (0, 128, 0, 128)
    assert l2.access([(2048, 128, 0, 1, 1)]) == (0, 0, 128, 62)   # then line 1 (62 dirty bytes)
    assert l2.dirty_bytes() == 128
    # no L2 at all: writes go straight through
    assert tl.L2Cache(0, 128).access([(0, 300, 0, 1, 1)]) == (0, 0, 300, 300)


def _write_launch(cores, passes, nbytes, base=1 << 32):
    """``cores`` AIVs, each writing its own ``nbytes`` of GM ``passes`` times (one MTE3 DataCopy each)."""
    out = []
    for b in range(cores):
        addr = base + b * (nbytes + 4096)
        recs = [[tl.MTE3, 0, 1, k + 1, nbytes, nbytes, 0, 0, 0] + [0] * 7 for k in range(passes)]
        gmr = [[k, addr, nbytes, 0, 1, 1] for k in range(passes)]
        out.append({"type": "aiv", "block": b, "recs": recs, "cross": [], "gmr": gmr})
    return {"kernel": "synthetic", "kind": "vector", "block_dim": cores, "names": ["DataCopy UB->GM"], "cores": out}


def test_a_rewritten_small_buffer_costs_one_hbm_write():
    nbytes, passes = 256 * 1024, 8
    m = tl.simulate(_write_launch(1, passes, nbytes), A2)
    # eight writes of 256 KiB reach HBM once: the lines dirty at the end of the launch
    assert m.hbm_bytes == nbytes and m.l2_writeback_bytes == nbytes == m.l2_dirty_end_bytes
    # the writes at the MTE3 rate into L2; the HBM carries the 256 KiB in less time, so nothing is added
    assert m.l2_flush_s == 0
    expect = passes * nbytes / (A2["mte3_gm_bytes_per_cycle"] * HZ)
    assert expect <= makespan(m) <= expect * 1.02 + 2 * A2["dma_latency_cycles"] / HZ, (makespan(m), expect)
    # with every write reaching HBM (no L2), the same launch moves 8 x 256 KiB through it
    assert tl.simulate(_write_launch(1, passes, nbytes), A2.scaled({"l2_bytes": 1e-9})).hbm_bytes == passes * nbytes


def test_dirty_lines_at_the_end_extend_a_launch_only_past_the_hbm_time():
    # 48 cores each write 1 MiB once: into L2 at the MTE3 rate in 1 MiB / (64 B/cycle) = 9.1 us, but
    # the 48 MiB still dirty at the end need 48 MiB / 1.6 TB/s = 31.5 us of HBM: the launch ends then
    nbytes = 1 << 20
    m = tl.simulate(_write_launch(48, 1, nbytes), A2)
    total = 48 * nbytes
    assert m.hbm_bytes == m.l2_dirty_end_bytes == total
    assert makespan(m) == pytest.approx(total / A2["gm_bandwidth"], rel=1e-9)
    run = nbytes / (A2["mte3_gm_bytes_per_cycle"] * HZ)
    assert m.l2_flush_s == pytest.approx(makespan(m) - run, rel=0.05)
    assert m.bound == "HBM bandwidth"


def test_a_write_stream_larger_than_l2_costs_its_full_size():
    # 48 cores each write 64 KiB twice to the same place, 3 MiB a pass: through a 1 MiB L2 the lines are
    # evicted before they are rewritten, so both passes reach HBM; through 192 MiB only one
    small = A2.scaled({"l2_bytes": 2 ** 20 / A2["l2_bytes"]})
    rec = _write_launch(48, 2, 64 * 1024)
    total = 2 * 48 * 64 * 1024
    m = tl.simulate(rec, small)
    assert m.hbm_bytes == total and m.l2_writeback_bytes == total
    expect = total / A2["gm_bandwidth"]
    assert expect * (1 - 1e-9) <= makespan(m, small) <= 1.05 * expect + 2 * A2["dma_latency_cycles"] / HZ
    assert m.bound == "HBM bandwidth"
    full = tl.simulate(rec, A2)
    assert full.hbm_bytes == total // 2
    assert makespan(full) < makespan(m, small)
    # one pass of a stream: the same HBM bytes whatever the L2 (evicted on the way, or written back at the end)
    one = _write_launch(48, 1, 64 * 1024)
    assert tl.simulate(one, small).hbm_bytes == tl.simulate(one, A2).hbm_bytes == total // 2


def test_a_reread_of_a_small_buffer_hits_l2():
    nbytes = 1 << 20
    m = tl.simulate(_dma_launch(1, 2, nbytes), A2)
    assert m.l2_hit_bytes == nbytes and m.hbm_bytes == nbytes
    # one core: the first pass at the per-core MTE2 rate from HBM, the second at the L2 read rate
    expect = nbytes / (A2["mte2_gm_bytes_per_cycle"] * HZ) + nbytes / (A2["l2_read_bytes_per_cycle"] * HZ)
    assert expect <= makespan(m) <= expect * 1.02 + 2 * A2["dma_latency_cycles"] / HZ, (makespan(m), expect)
    # without the L2 (capacity below the buffer) the re-read misses and costs the HBM pass again
    no_l2 = A2.scaled({"l2_bytes": 0.001})
    m0 = tl.simulate(_dma_launch(1, 2, nbytes), no_l2)
    assert m0.l2_hit_bytes == 0 and m0.hbm_bytes == 2 * nbytes
    assert makespan(m0, no_l2) == pytest.approx(2 * nbytes / (A2["mte2_gm_bytes_per_cycle"] * HZ), rel=0.02)


def test_a_stream_larger_than_l2_costs_hbm_bandwidth():
    # 48 cores each stream 64 KiB twice (3 MiB a pass); with a 1 MiB L2 the LRU keeps nothing useful
    small = A2.scaled({"l2_bytes": 2 ** 20 / A2["l2_bytes"]})
    rec = _dma_launch(48, 2, 64 * 1024)
    m = tl.simulate(rec, small)
    total = 2 * 48 * 64 * 1024
    assert m.l2_hit_bytes == 0 and m.hbm_bytes == total
    expect = total / A2["gm_bandwidth"]
    assert expect <= makespan(m, small) <= 1.05 * expect + 2 * A2["dma_latency_cycles"] / HZ
    assert m.bound == "HBM bandwidth"
    # with the chip's 192 MiB the second pass hits, and only the first pass uses HBM
    full = tl.simulate(rec, A2)
    assert full.l2_hit_bytes == total // 2 and full.hbm_bytes == total // 2
    assert makespan(full) < makespan(m, small)
    # a buffer written once reaches HBM once (written back at the end of the launch)
    w = tl.simulate(_dma_launch(4, 2, 64 * 1024, write_back=True), A2)
    assert w.hbm_bytes == 4 * 64 * 1024 * 2 and w.l2_hit_bytes == 4 * 64 * 1024
    assert w.l2_writeback_bytes == 4 * 64 * 1024


def test_l2_capacity_and_rate_sensitivity_is_monotone():
    rec = _dma_launch(48, 3, 64 * 1024)  # 3 MiB a pass
    def t(**f):
        tab = A2.scaled(f)
        return makespan(tl.simulate(rec, tab), tab)
    caps = [t(l2_bytes=c / 192) for c in (0.5, 1, 2, 4, 192)]  # MiB
    assert all(a >= b * (1 - 1e-9) for a, b in zip(caps, caps[1:])), caps
    assert caps[0] > 1.5 * caps[-1]
    rates = [t(l2_read_bytes_per_cycle=f) for f in (0.5, 0.7, 1.0, 1.3, 2.0)]
    assert all(a >= b * (1 - 1e-9) for a, b in zip(rates, rates[1:])), rates
    assert rates[0] > rates[-1]


@pytest.mark.parametrize("case", ["copy", "mmad_chain", "pipe_double", "pipe_single"])
def test_critical_path_adds_up_to_the_predicted_time(driver, case):
    m = tl.simulate(launch(driver, case))
    assert sum(m.critical_path.values()) == pytest.approx(m.predicted_s, rel=1e-9)
    assert m.critical_path["launch latency"] == pytest.approx(A2["launch_latency_s"])
    assert min(m.critical_path.values()) > 0


def test_critical_path_names_the_stage_that_bounds(driver):
    # a chain of Mmads: the Cube's busy time is nearly the whole path
    m = tl.simulate(launch(driver, "mmad_chain"))
    assert m.critical_path["M busy"] > 0.9 * makespan(m)
    # single buffering: the path runs through every stage of every tile (load, vector, store)
    t = A2.scaled(NO_LATENCY)
    load, vec, store = _stages(t)
    m = tl.simulate(launch(driver, "pipe_single"), t)
    cp = m.critical_path
    assert cp["MTE2 busy"] == pytest.approx(64 * load, rel=0.05)
    assert cp["V busy"] == pytest.approx(64 * vec, rel=0.05)
    assert cp["MTE3 busy"] == pytest.approx(64 * store, rel=0.05)
    # double buffering: the longest stage (the load) carries the path, the others are hidden
    m = tl.simulate(launch(driver, "pipe_double"), t)
    assert m.critical_path["MTE2 busy"] > 0.9 * makespan(m, t)
    assert m.critical_path.get("V busy", 0.0) < 0.05 * makespan(m, t)


@pytest.mark.parametrize("argv, named", [
    # --ops nosuch used to give "models": [] and exit 0; an unknown sensitivity key a KeyError traceback
    (["--ops", "nosuch"], "'nosuch' matches no case"),
    (["--ops", "moe_permute", "grouped_gem_fwd"], "'grouped_gem_fwd' matches no case"),
    (["--sensitivity", "--sensitivity-keys", "nosuch"], "--sensitivity-keys: unknown key 'nosuch'"),
    (["--sensitivity-keys", "clock_hz"], "--sensitivity-keys needs --sensitivity"),
    (["--table", "nosuch"], "--table"),
])
def test_a2_bench_bad_flags_are_argparse_errors(argv, named, capsys, monkeypatch):
    from ascend_moe_ops.perfmodel import a2_bench as ab
    monkeypatch.setattr(ab, "run", lambda *a, **k: pytest.fail("ran with a bad flag"))
    with pytest.raises(SystemExit) as e:
        ab.main(["--preset", "quick", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert named in err
    if argv[0] == "--ops":
        assert "available ops:" in err and "moe_permute" in err and "grouped_gemm fwd" in err
    if "nosuch" in argv and "--sensitivity" in argv:
        assert "clock_hz" in err and "cube_cores" not in err


def _core(recs, type_="aiv"):
    return dict(type=type_, block=0, recs=recs)


def test_launch_with_no_cores_is_its_launch_latency():
    # used to divide 0 by 0 (the L2 read utilisation); a core with no records already modelled this way
    m = tl.simulate(dict(kernel="k", kind="v", cores=[]))
    assert m.predicted_s == A2["launch_latency_s"] and m.blocks == 0
    assert tl.simulate(dict(kernel="k", kind="v", cores=[_core([])])).predicted_s == m.predicted_s


@pytest.mark.parametrize("launch, exc, msg", [
    (dict(kernel="k", kind="v", cores=[_core([[1, 0, 1, 1, 0, 256, 0, 0, 0] + [0] * 7], "mix")]), ValueError,
     r"cores\[0\]\['type'\] must be one of aiv, aic, got 'mix'"),  # was ZeroDivisionError
    (dict(kind="v", cores=[]), ValueError, "launch has no 'kernel' field"),  # was KeyError
    (dict(kernel="k", kind="v", cores=[_core([[4, 0, 1, 1, 4096]])]), ValueError,
     r"\['recs'\]\[0\] must be a list of at least 16 numbers"),  # was IndexError
    (dict(kernel="k", kind="v", cores=[_core([[12, 0, 1, 1, 0, 0, 0, 0, 0] + [0] * 7])]), ValueError,
     r"\['recs'\]\[0\]\[0\] \(the pipe\) must be an int in 0..8"),  # was IndexError
    (dict(kernel="k", kind="v", cores={}), TypeError, r"launch\['cores'\] must be a list"),
    ([], TypeError, "launch must be a dict"),
])
def test_malformed_launch_is_named(launch, exc, msg):
    with pytest.raises(exc, match=msg):
        tl.simulate(launch)


def test_table_and_recording_arguments_are_checked(tmp_path):
    with pytest.raises(TypeError, match="table must be a HardwareTable, a shipped table's name or a JSON path, got dict"):
        tl.simulate(dict(kernel="k", kind="v", cores=[]), {"clock_hz": 1e9})  # was a pathlib TypeError
    with pytest.raises(ValueError, match="'launches' list"):
        tl.load_recording("{}")  # was KeyError('launches')
    d = json.loads(json.dumps({"name": "a2", "title": "t", "version": "x", "params": {
        k: {"value": p.value, "unit": p.unit, "source": "copied from the shipped a2 table"}
        for k, p in A2.params.items() if k != "clock_hz"}}))
    (tmp_path / "t.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match="lacks 'clock_hz', which the A2 timeline needs"):
        tl.simulate(dict(kernel="k", kind="v", cores=[]), str(tmp_path / "t.json"))


def test_a2_bench_table_and_output_paths_checked_before_recording(tmp_path, capsys, monkeypatch):
    """A table lacking a key was a KeyError traceback; a --json in a missing folder failed only after
    every case was recorded and modelled; a --trace-dir that is a file gave FileExistsError."""
    from ascend_moe_ops.perfmodel import a2_bench as ab
    monkeypatch.setattr(ab, "run", lambda *a, **k: pytest.fail("ran with a bad flag"))
    d = json.loads(json.dumps({"name": "a2", "title": "t", "version": "x", "params": {
        k: {"value": p.value, "unit": p.unit, "source": "copied from the shipped a2 table"}
        for k, p in A2.params.items() if k != "clock_hz"}}))
    (tmp_path / "t.json").write_text(json.dumps(d))
    f = tmp_path / "file"
    f.write_text("x")
    for argv, named in [(["--table", str(tmp_path / "t.json")], "lacks 'clock_hz', which the A2 timeline needs"),
                        (["--json", str(tmp_path / "nosuch" / "x.json")], "argument --json: no folder"),
                        (["--json", str(tmp_path)], "argument --json: " + repr(str(tmp_path)) + " is a folder"),
                        (["--trace-dir", str(f)], "argument --trace-dir: " + repr(str(f)) + " exists and is not a folder")]:
        with pytest.raises(SystemExit) as e:
            ab.main(["--preset", "quick", *argv])
        assert e.value.code == 2
        assert named in capsys.readouterr().err
