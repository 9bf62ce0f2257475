"""grouped_gemm benchmark: forward, dX and dW separately, balanced / Zipf-skewed / fine-grained
routing, against dense ``torch.mm`` on the same total problem, ``torch._grouped_mm`` and a
per-expert ``torch.mm`` loop, all timed in the same process; plus one MoELayer forward+backward
row against a pure-PyTorch MoE layer (Megatron-style sequential experts).

    python -m ascend_moe_ops.bench --ops grouped_gemm [--full]
    python -m ascend_moe_ops.bench --ops grouped_gemm --gemm-shape E=32,M=8192,K=2048,N=1408,sizes=zipf
    python -m pytest bench/ --amo-ops grouped_gemm        # the same cases under pytest-benchmark

FLOPs = 2 * sum(group_sizes) * K * N per GEMM (the same for fwd, dX and dW). Peers give the time
ratio peer/ours: ``dense torch.mm`` > 1x means faster than one dense GEMM of the same total size
(so the ratio is our "% of dense"), ``torch._grouped_mm`` / ``per-expert loop`` > 1x: faster.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

import ascend_moe_ops as amo
from ascend_moe_ops import _backends
from ascend_moe_ops.bench import Row, parity_row

OP = "grouped_gemm"


def zipf_sizes(E: int, total: int, alpha: float = 1.2, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** alpha
    w = w[torch.randperm(E, generator=g)]
    sizes = torch.floor(w / w.sum() * total).to(torch.int64)
    sizes[int(torch.argmax(w))] += total - int(sizes.sum())
    return sizes


def balanced_sizes(E: int, total: int) -> torch.Tensor:
    """``total`` rows over ``E`` groups, sizes differing by at most one (M // E each when E | M)."""
    sizes = torch.full((E,), total // E, dtype=torch.int64)
    sizes[: total % E] += 1
    return sizes


PRESET_CASES = {
    True: [(8, 2048, 1024, 704, "balanced"), (8, 2048, 1024, 704, "zipf"), (64, 4096, 512, 256, "fine")],
    False: [(32, 8192, 2048, 1408, "balanced"), (32, 8192, 2048, 1408, "zipf"),
            (256, 16384, 512, 256, "fine")],
}


def cases(quick: bool, shapes=None):
    """(name, E, M, K, N, sizes): the preset's three (balanced, Zipf, fine-grained), or ``shapes``
    (``--gemm-shape`` dicts {E, M, K, N, sizes})."""
    if shapes:
        spec = [(d["E"], d["M"], d["K"], d["N"], d.get("sizes", "balanced")) for d in shapes]
    else:
        spec = PRESET_CASES[bool(quick)]
    for E, M, K, N, kind in spec:
        name = f"{kind} E{E} M{M} K{K} N{N}"
        sizes = zipf_sizes(E, M) if kind == "zipf" else balanced_sizes(E, M)
        yield name, E, M, K, N, sizes


def _backends_here(device, wanted=lambda name: True):
    if device.type == "cuda":
        return [b for b in ("triton",) if b in _backends.available_backends(OP, device) and wanted(b)]
    return [b for b in ("native",) if b in _backends.available_backends(OP, device) and wanted(b)]


#: the least bytes each pass moves (each operand read once, the result written once; s = element size)
_BYTES = {"fwd": "bytes = s * (M*K + E*K*N + M*N)", "dX": "bytes = s * (M*N + E*K*N + M*K)",
          "dW": "bytes = s * (M*K + M*N + E*K*N)"}

PATHS = {"fwd": "grouped GEMM fwd x_e @ W_e (Megatron GroupedMLP gmm(a, b, batch_sizes) path)",
         "dX": "grouped GEMM dX = dy_e @ W_e^T (gmm trans_b, the backward of fc1/fc2)",
         "dW": "grouped GEMM dW_e = x_e^T @ dy_e (weight gradient of GroupedMLP)"}


def _cpu_has_amx() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return " amx_bf16" in f.read()
    except OSError:
        return False


def _avx512_kernel(fn):
    """``fn`` with the native kernel's AMX path and its per-group mm path switched off
    (AMO_GG_AMX=0, AMO_GG_MM=0, read per call): the AVX-512 BF16 tile kernel, timed in the same run
    as a peer where the CPU has AMX."""
    def run():
        old = {k: os.environ.get(k) for k in ("AMO_GG_AMX", "AMO_GG_MM")}
        os.environ.update(AMO_GG_AMX="0", AMO_GG_MM="0")
        try:
            return fn()
        finally:
            for k, v in old.items():
                if v is None:
                    del os.environ[k]
                else:
                    os.environ[k] = v
    return run


def _loop(a, b_of, sizes_list, out):
    start = 0
    for e, g in enumerate(sizes_list):
        if g:
            torch.mm(a[start:start + g], b_of(e), out=out[start:start + g])
        start += g
    out[start:].zero_()
    return out


def _loop_dw(x, dy, sizes_list, out):
    start = 0
    for e, g in enumerate(sizes_list):
        if g:
            torch.mm(x[start:start + g].t(), dy[start:start + g], out=out[e])
        else:
            out[e].zero_()
        start += g
    return out


def run(ctx):
    dev = ctx.device
    dtype = ctx.dtype
    dname = str(dtype).replace("torch.", "")
    rows = []
    min_time = None if ctx.quick else 0.5
    for name, E, M, K, N, sizes in cases(ctx.quick, getattr(ctx, "gemm_shapes", None)):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(M, K, generator=g).to(dtype).to(dev)
        w = (torch.randn(E, K, N, generator=g) / K ** 0.5).to(dtype).to(dev)
        dy = torch.randn(M, N, generator=g).to(dtype).to(dev)
        dense_b = torch.randn(K, N, generator=g).to(dtype).to(dev)
        gs = sizes.to(dev)
        sl = sizes.tolist()
        offs = torch.cumsum(gs, 0, dtype=torch.int32)
        wt = w.transpose(1, 2)
        flops = 2 * int(sizes.sum()) * K * N
        formula = "flops = 2 * sum(group_sizes) * K * N"
        passes = {
            "fwd": (lambda: amo.grouped_gemm(x, w, gs),
                    {"dense torch.mm": lambda: torch.mm(x, dense_b),
                     "torch._grouped_mm": lambda: torch._grouped_mm(x, w, offs=offs),
                     "per-expert loop": lambda: _loop(x, lambda e: w[e], sl, x.new_empty(M, N))}),
            "dX": (lambda: amo.grouped_gemm(dy, w, gs, trans_b=True),
                   {"dense torch.mm": lambda: torch.mm(dy, dense_b.t()),
                    "torch._grouped_mm": lambda: torch._grouped_mm(dy, wt, offs=offs),
                    "per-expert loop": lambda: _loop(dy, lambda e: w[e].t(), sl, x.new_empty(M, K))}),
            "dW": (lambda: amo.grouped_gemm_dw(x, dy, gs),
                   {"dense torch.mm": lambda: torch.mm(x.t(), dy),
                    "torch._grouped_mm": lambda: torch._grouped_mm(x.t(), dy, offs=offs),
                    "per-expert loop": lambda: _loop_dw(x, dy, sl, x.new_empty(E, K, N))}),
        }
        for pname, (ours, peers) in passes.items():
            peer_t = {}
            for peer, fn in peers.items():
                try:
                    peer_t[peer] = ctx.time(fn, min_time=min_time)
                except Exception as exc:  # e.g. a torch build without _grouped_mm for this dtype
                    print(f"  [{OP}] peer {peer} failed: {exc}")
            for backend in _backends_here(dev, ctx.backend_wanted):
                with amo.use_backend(backend):
                    t = ctx.time(ours, min_time=min_time)
                    if backend == "native" and dtype == torch.bfloat16 and _cpu_has_amx():
                        peer_t = dict(peer_t, **{"native AVX-512 kernel (AMO_GG_AMX=0)":
                                                 ctx.time(_avx512_kernel(ours), min_time=min_time)})
                extra = {"E": E, "M": M, "K": K, "N": N, "pass": pname,
                         "max_group": max(sl), "empty_groups": sum(1 for s in sl if s == 0)}
                # the least memory traffic of the pass (each operand read once, result written
                # once): fine-grained experts stream their weights from DRAM on every call
                elt = x.element_size()
                min_bytes = elt * ({"fwd": M * K + E * K * N + M * N, "dX": M * N + E * K * N + M * K,
                                    "dW": M * K + M * N + E * K * N}[pname])
                extra["min_bytes"] = min_bytes
                extra["GBps_at_min_bytes"] = round(min_bytes / t / 1e9, 2)
                if "dense torch.mm" in peer_t:
                    extra["pct_of_dense_same_problem"] = round(100 * peer_t["dense torch.mm"] / t, 1)
                mm = {"fwd": (M, K, N), "dX": (M, N, K), "dW": (K, M, N)}[pname]
                if hasattr(ctx, "limit_now"):
                    ctx.limit_now(mm_shape=mm, dtype=dtype)  # the limit column, next to the row
                rows.append(Row(op=OP, case=f"{pname} {name}", backend=backend, dtype=dname,
                                seconds=t, flops=flops, bytes=min_bytes, formula=formula + ", " + _BYTES[pname],
                                limit="flops",
                                peers=peer_t, extra=extra, path=PATHS[pname], mm_shape=mm))
    rows += _moe_layer_rows(ctx, dtype, min_time)
    return rows


def sequential_moe(layer, x):
    """Pure-PyTorch MoE (Megatron SequentialMLP style): per expert, gather its tokens, dense
    SwiGLU MLP, scatter-add weighted by the router probs."""
    ids, probs, _ = layer.router(x)
    out = torch.zeros_like(x)
    w1, w2 = layer.experts.w1(), layer.experts.w2()
    for e in range(layer.num_experts):
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        h = x[tok] @ w1[e]
        gate, up = h.chunk(2, -1)
        y = (F.silu(gate) * up) @ w2[e]
        out = out.index_add(0, tok, y * probs[tok, slot].to(x.dtype).unsqueeze(1))
    return out


def _moe_layer_rows(ctx, dtype, min_time):
    dev = ctx.device
    T, H, E, Fh, K = (512, 512, 16, 256, 4) if ctx.quick else (4096, 1024, 64, 512, 8)
    torch.manual_seed(0)
    layer = amo.nn.MoELayer(H, E, Fh, K, dtype=dtype, device=dev)
    x = torch.randn(T, H, device=dev).to(dtype).requires_grad_()
    flops = 3 * 2 * T * K * (H * 2 * Fh + Fh * H)  # expert GEMMs, fwd + bwd (2x)
    rows = []

    def step(fn):
        def f():
            layer.zero_grad(set_to_none=True)
            x.grad = None
            fn(x).float().sum().backward()
        return f

    peer = {"pure-PyTorch MoE (sequential experts)": ctx.time(step(lambda t: sequential_moe(layer, t)),
                                                            min_time=min_time)}
    with amo.use_backend(None):  # default backends (whatever each op has here)
        t = ctx.time(step(layer), min_time=min_time)
    used = {op: _backends.active_backend(op, dev) for op in ("grouped_gemm", "moe_permute", "moe_unpermute")}
    rows.append(Row(op=OP, case=f"MoELayer fwd+bwd T{T} H{H} E{E} F{Fh} k{K}", backend="default",
                    dtype=str(dtype).replace("torch.", ""),
                    path="full MoE layer fwd+bwd: router, permute, grouped SwiGLU experts, unpermute "
                         "(ascend_moe_ops.nn.MoELayer)", seconds=t, flops=flops, limit="flops",
                    formula="MoELayer flops = 3 * 2 * T * k * 3 * H * F (expert GEMMs, fwd+bwd)",
                    peers=peer, extra={"T": T, "H": H, "E": E, "F": Fh, "k": K, "backends": used}))
    return rows


def parity(ctx):
    """bf16 fwd / dX / dW of every backend here vs the fp64 reference, on a Zipf case."""
    dev = ctx.device
    out = []
    sizes = zipf_sizes(16, 1000)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1024, 256, generator=g)
    w = torch.randn(16, 256, 192, generator=g) / 16
    dy = torch.randn(1024, 192, generator=g)
    backends = _backends_here(dev)
    if "ascendc-emu" in _backends.available_backends(OP, dev):
        backends = backends + ["ascendc-emu"]  # the AscendC Cube kernels on the emulator: parity only
    for backend in backends:
        for name, fn in {"fwd": lambda a, b, c: amo.grouped_gemm(a, b, sizes.to(dev)),
                         "dX": lambda a, b, c: amo.grouped_gemm(c, b, sizes.to(dev), trans_b=True),
                         "dW": lambda a, b, c: amo.grouped_gemm_dw(a, c, sizes.to(dev))}.items():
            with amo.use_backend("reference"):
                ref64 = fn(x.double().to(dev), w.double().to(dev), dy.double().to(dev))
                lowp = fn(*(t.to(torch.bfloat16).to(dev) for t in (x, w, dy)))
            with amo.use_backend(backend):
                res = fn(*(t.to(torch.bfloat16).to(dev) for t in (x, w, dy)))
            out.append(parity_row(OP, f"{name} zipf E16 M1024 K256 N192", backend, res, ref64, lowp))
    return out
