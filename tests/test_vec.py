"""csrc/common/vec.h, the vector layer of the native CPU kernels, on every instruction set it has:
the scalar fallback, AVX2 (+FMA, F16C) and AVX-512, each compiled from tests/_vec_probe.cpp into a
small shared library (the extension itself is built for this machine's -march=native only).

The three versions must give the same bits (loads, stores with their rounding, fma/add/mul,
exp/sigmoid, the pairwise reduction, streaming copies), and the conversions must equal PyTorch's."""

import ctypes
import os
import pathlib
import shutil
import subprocess

import pytest
import torch

from ascend_moe_ops.testing import cpu_flags

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROBE = ROOT / "tests" / "_vec_probe.cpp"
DTYPES = {0: torch.float32, 1: torch.bfloat16, 2: torch.float16, 3: torch.float64}
# -march per version; the CPU must run it (flags from /proc/cpuinfo)
ISAS = {"scalar": ("x86-64", set()), "avx2": ("haswell", {"avx2", "fma", "f16c"}),
        "avx512": ("skylake-avx512", {"avx512f", "avx512bw", "avx512vl", "avx512dq"})}


def _compiler():
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


pytestmark = pytest.mark.skipif(
    os.uname().machine not in ("x86_64", "AMD64") or _compiler() is None,
    reason="the probe's instruction sets are x86-64 ones and need a C++ compiler")


@pytest.fixture(scope="module")
def libs(tmp_path_factory):
    """{isa: ctypes library} for every version this CPU can run."""
    out = tmp_path_factory.mktemp("vec_probe")
    torch_inc = pathlib.Path(torch.__file__).parent / "include"
    flags = cpu_flags()
    built = {}
    for isa, (march, need) in ISAS.items():
        if not need <= flags:
            continue
        so = out / f"vec_{isa}.so"
        cmd = [_compiler(), "-O2", "-std=c++17", "-ffp-contract=off", f"-march={march}", "-shared", "-fPIC",
               f"-I{ROOT / 'csrc'}", f"-I{torch_inc}", str(PROBE), "-o", str(so)]
        subprocess.run(cmd, check=True, capture_output=True, text=True)
        lib = ctypes.CDLL(str(so))
        lib.amo_vec_isa.restype = ctypes.c_int
        built[isa] = lib
    return built


def _ptr(t):
    return ctypes.c_void_p(t.data_ptr())


def _specials(n, dtype, seed):
    """Random values with NaN, +-inf, +-0, subnormals (of fp32, bf16 and fp16), bf16 rounding ties,
    exp's clamp range, and magnitudes that overflow fp16."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64) * 4
    sp = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-40, -3e-39, 1e-45,
                       6e-8, -5.9e-5, 1.00390625, 1.01171875, -1.00390625, 90.0, -95.0, 88.5, -87.5,
                       7e4, -1e5, 3.4e38], dtype=torch.float64)
    x[: sp.numel()] = sp
    x[sp.numel():] = x[sp.numel():][torch.randperm(n - sp.numel(), generator=g)]
    return x.to(dtype)


N = 16 * 7 + 9  # whole vectors, a sparse-mask vector every third, and a tail


def test_the_machine_builds_its_own_version(libs):
    assert "scalar" in libs
    assert libs["scalar"].amo_vec_isa() == 0
    if "avx2" in libs:
        assert libs["avx2"].amo_vec_isa() == 256
    if "avx512" in libs:
        assert libs["avx512"].amo_vec_isa() == 512


@pytest.mark.parametrize("din", [0, 1, 2, 3], ids=lambda d: f"from-{DTYPES[d]}")
@pytest.mark.parametrize("dout", [0, 1, 2, 3], ids=lambda d: f"to-{DTYPES[d]}")
def test_convert_equals_torch_on_every_isa(libs, din, dout):
    x = _specials(N, torch.float64, seed=din * 4 + dout).to(DTYPES[din])
    # PyTorch: fp64 -> the dtype goes through fp32 in the vector layer (it computes in fp32)
    want = x.to(torch.float32).to(DTYPES[dout])
    sentinel = torch.full((N,), 7.0, dtype=DTYPES[dout])
    lanes = torch.ones(N, dtype=torch.bool)  # lanes a sparse-mask store writes
    for j in range(0, N // 16):
        if j % 3 == 2:
            bits = 0xA5C3
            lanes[16 * j:16 * j + 16] = torch.tensor([(bits >> i) & 1 == 1 for i in range(16)])
    want = torch.where(lanes, want, sentinel)
    for isa, lib in libs.items():
        out = sentinel.clone()
        lib.amo_vec_convert(din, _ptr(x), dout, _ptr(out), ctypes.c_int64(N))
        nan = torch.isnan(want)
        assert torch.equal(torch.isnan(out), nan), isa  # NaN payloads are not PyTorch's concern
        assert torch.equal(out[~nan].view(torch.uint8), want[~nan].view(torch.uint8)), (isa, out, want)
        if dout == 1:  # every bf16 NaN is 0x7FC0 (common/bf16.h)
            assert (out[nan].view(torch.int16) == 0x7FC0).all(), isa


@pytest.mark.parametrize("dtype", [0, 1, 2, 3], ids=lambda d: str(DTYPES[d]))
def test_math_is_bitwise_the_same_on_every_isa(libs, dtype):
    x = _specials(N, DTYPES[dtype], seed=10 + dtype)
    y = (torch.randn(N, generator=torch.Generator().manual_seed(20 + dtype)) * 3).to(DTYPES[dtype])
    results = {}
    for isa, lib in libs.items():
        out = torch.zeros(N, dtype=DTYPES[dtype])
        nt = torch.zeros(N + 64, dtype=DTYPES[dtype])
        off = (-nt.data_ptr() % 64) // nt.element_size()  # a 64-byte aligned start
        nt = nt[off:off + N]
        red = torch.zeros((N + 15) // 16, dtype=torch.float32)
        lib.amo_vec_math(dtype, _ptr(x), _ptr(y), ctypes.c_int64(N), _ptr(out), _ptr(red), _ptr(nt))
        results[isa] = (out, red, nt.clone())
    ref_out, ref_red, ref_nt = results["scalar"]
    full = N // 16 * 16
    assert torch.equal(ref_nt[:full].view(torch.uint8), ref_out[:full].view(torch.uint8))
    for isa, (out, red, nt) in results.items():
        assert torch.equal(out.view(torch.uint8), ref_out.view(torch.uint8)), isa
        assert torch.equal(red.view(torch.int32), ref_red.view(torch.int32)), isa
        assert torch.equal(nt[:full].view(torch.uint8), ref_nt[:full].view(torch.uint8)), isa
    # and the formula is right: against fp64 (fp32 math, ~1e-6 relative, then the dtype's rounding)
    v, w = x.double(), y.double()
    b = (v * 1.5 + w) * v + (w - v)
    want = torch.exp((v * 0.25).clamp(-87, 88)) * torch.sigmoid(b)
    tiny = torch.finfo(DTYPES[dtype] if dtype != 3 else torch.float32).tiny  # below: subnormal rounding
    ok = torch.isfinite(want) & torch.isfinite(v) & (want.abs() > tiny) & (want.abs() < 6e4)
    got = ref_out.double()
    tol = {0: 1e-5, 1: 1e-2, 2: 2e-3, 3: 1e-5}[dtype]
    torch.testing.assert_close(got[ok], want[ok], rtol=tol, atol=0)


@pytest.mark.parametrize("stream", [0, 1])
@pytest.mark.parametrize("misalign,size", [(0, 4096), (5, 1000), (33, 300), (1, 255), (0, 7)])
def test_copy_and_zero_bytes(libs, stream, misalign, size):
    src = torch.randint(0, 256, (size + 64,), dtype=torch.uint8, generator=torch.Generator().manual_seed(size))
    for isa, lib in libs.items():
        buf = torch.full((size + 128,), 0xEE, dtype=torch.uint8)
        start = (-buf.data_ptr() % 64) + misalign
        lib.amo_vec_copy(_ptr(buf[start:]), _ptr(src[3:]), ctypes.c_int64(size), stream)
        assert torch.equal(buf[start:start + size], src[3:3 + size]), isa
        assert (buf[:start] == 0xEE).all() and (buf[start + size:] == 0xEE).all(), isa
        lib.amo_vec_zero(_ptr(buf[start:]), ctypes.c_int64(size), stream)
        assert (buf[start:start + size] == 0).all() and (buf[start + size:] == 0xEE).all(), isa
