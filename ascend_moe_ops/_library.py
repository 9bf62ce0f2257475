"""The one registration point: every schema of ascend_moe_ops is defined here, once per namespace.

Namespaces (same schemas in each):

==========================  =================================================================
``ascend_moe_ops``          the public ops; one kernel per dispatch key, bound once at import
                            (``_backends.bind_public``): CPU and CUDA here, PrivateUse1 by
                            ``_npu.py`` on an Ascend build
``ascend_moe_ops_native``   C++ kernels of ``csrc/cpu`` (``TORCH_LIBRARY_IMPL(..., CPU, m)`` in
                            the extension ``ascend_moe_ops._C``)
``ascend_moe_ops_triton``   Triton kernels of ``triton_ref/`` (CUDA; CPU under TRITON_INTERPRET=1)
``ascend_moe_ops_emu``      the AscendC kernels on the CPU emulation layer
                            (``ascend_moe_ops._ascendc_emu``, tests only)
``ascend_moe_ops_ref``      the pure-PyTorch reference (``ascend_moe_ops/reference``)
==========================  =================================================================

Native code never defines a schema; it only adds implementations. The op modules in
``ascend_moe_ops/ops`` register, for every namespace, the fake (meta) kernel, which runs the
metadata part of the op's contract check (``ops/_contracts.py``), and the autograd formula, whose
backward calls the ops of the same namespace (so each backend is opcheck-able and differentiable on
its own). The Python backends' kernels are registered by :func:`python_kernel`: each runs
the full contract check, then the implementation.

Autograd of the public namespace is C++ when the extension ``ascend_moe_ops._C`` is built:
``csrc/cpu/autograd.cpp`` registers, at the ``Autograd`` alias key (so for CPU, CUDA and
PrivateUse1 tensors alike), one ``torch::autograd::Function`` per op with a formula, the same
formula as the op module's Python one (same saved tensors, non-differentiable outputs and backward
ops, called through the dispatcher). This module imports the extension before the op modules
register (:data:`NATIVE_AUTOGRAD`), and :func:`register_op` then leaves the public namespace's
Python formula out: a call of ``torch.ops.ascend_moe_ops.<op>``, and its backward, run no Python
between the dispatcher and the kernel (``tests/test_op_dispatch_path.py``). Without the extension
(built with ``ASCEND_MOE_OPS_NO_NATIVE=1``) the Python formula serves the public namespace too. The
backend namespaces always use the Python formulas.

Conventions: optional ints are ``int?`` (``None``); index outputs are int32 (row maps) or int64
(counts).
"""

from __future__ import annotations

import functools
import importlib
from typing import Callable, Dict, Optional

import torch

NAMESPACE = "ascend_moe_ops"
BACKEND_NAMESPACES: Dict[str, str] = {
    "native": "ascend_moe_ops_native",
    "triton": "ascend_moe_ops_triton",
    "ascendc-emu": "ascend_moe_ops_emu",
    "reference": "ascend_moe_ops_ref",
}
NAMESPACES = (NAMESPACE,) + tuple(BACKEND_NAMESPACES.values())

SCHEMAS = {
    # moe_permute(tokens [T,H], routing [T,K] int ids (-1 = empty) | [T,E] bool, probs same shape
    # as routing or None, num_experts, capacity (None = dropless), align (>=1), num_out_tokens
    # (None = static bound T*K; n >= 0, dropless only: N = n + E*(align-1) rows, and only the first n
    # routed slots in (expert, token, slot) order are kept, TransformerEngine's rule: below the
    # routed count the tail of the highest experts is dropped)) -> (permuted_tokens [N,H],
    # permuted_probs [N] (shape [0] without probs), row_id_map [T,K] int32 (-1 = not kept: empty,
    # over capacity or past num_out_tokens), tokens_per_expert [E] int64 (kept slots),
    # group_sizes [E] int64). The row map spec: reference/moe_permute.py's docstring.
    "moe_permute": "moe_permute(Tensor tokens, Tensor routing, Tensor? probs, int num_experts, "
                   "int? capacity, int align, int? num_out_tokens) "
                   "-> (Tensor, Tensor, Tensor, Tensor, Tensor)",
    # moe_unpermute(permuted [N,H], row_id_map [T,K] int32/int64, probs [T,K] or None) -> [T,H]
    "moe_unpermute": "moe_unpermute(Tensor permuted, Tensor row_id_map, Tensor? probs) -> Tensor",
    # backward of moe_unpermute: (grad_permuted [N,H], grad_probs [T,K] (shape [0] without probs))
    "moe_unpermute_backward": "moe_unpermute_backward(Tensor grad_out, Tensor permuted, "
                              "Tensor row_id_map, Tensor? probs) -> (Tensor, Tensor)",
    # flash_attention_fwd(q [Tq,Hq,Dq], k [Tk,Hkv,Dk], v [Tk,Hkv,Dv] (Hkv divides Hq: GQA/MQA, q head
    # h uses kv head h // (Hq // Hkv)), k_rope [Tk,Dr] or None (a key part shared by every head: then
    # Dq = Dk + Dr and score = q[:, :Dk]·k + q[:, Dk:]·k_rope), cu_seqlens_q / cu_seqlens_k [B+1]
    # int32/int64 (packed sequences; sequence b has Lq_b queries and Lk_b keys), max_seqlen_q /
    # max_seqlen_k (>= the longest), causal (bottom-right aligned: query i sees keys
    # j <= i + Lk_b - Lq_b), softmax_scale) -> (out [Tq,Hq,Dv] in q's dtype, lse [Hq,Tq]
    # natural-log logsumexp of the scaled scores, fp32 (fp64 for fp64 inputs); a row that sees no
    # key has out = 0 and lse = -inf)
    "flash_attention_fwd": "flash_attention_fwd(Tensor q, Tensor k, Tensor v, Tensor? k_rope, "
                           "Tensor cu_seqlens_q, Tensor cu_seqlens_k, int max_seqlen_q, "
                           "int max_seqlen_k, bool causal, float softmax_scale) -> (Tensor, Tensor)",
    # flash_attention_bwd(grad_out [Tq,Hq,Dv], q, k, v, k_rope, out, lse, cu_seqlens_q,
    # cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale) -> (dq [Tq,Hq,Dq],
    # dk [Tk,Hkv,Dk], dv [Tk,Hkv,Dv] (summed over the q heads of each group), dk_rope [Tk,Dr]
    # summed over heads (shape [0] without k_rope)), all in q's dtype
    "flash_attention_bwd": "flash_attention_bwd(Tensor grad_out, Tensor q, Tensor k, Tensor v, "
                           "Tensor? k_rope, Tensor out, Tensor lse, Tensor cu_seqlens_q, "
                           "Tensor cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, bool causal, "
                           "float softmax_scale) -> (Tensor, Tensor, Tensor, Tensor)",
    # mla_attention_fwd(q [T,H,Dn+Dr], c_kv [T,Dc], k_pe [T,Dr], w_kv_up [H*(Dn+Dv),Dc],
    # cu_seqlens [B+1], max_seqlen, num_heads H, qk_nope_dim Dn, v_dim Dv, softmax_scale, causal,
    # save_kv) -> (out [T,H,Dv], lse [H,T] fp32, kv [T,H*(Dn+Dv)] the up-projected latent when
    # save_kv (recompute="none"), else shape [0])
    "mla_attention_fwd": "mla_attention_fwd(Tensor q, Tensor c_kv, Tensor k_pe, Tensor w_kv_up, "
                         "Tensor cu_seqlens, int max_seqlen, int num_heads, int qk_nope_dim, "
                         "int v_dim, float softmax_scale, bool causal, bool save_kv) "
                         "-> (Tensor, Tensor, Tensor)",
    # mla_attention_bwd(grad_out [T,H,Dv], q, c_kv, k_pe, w_kv_up, out, lse, kv ([0] = recompute
    # it from c_kv and w_kv_up), cu_seqlens, max_seqlen, num_heads, qk_nope_dim, v_dim,
    # softmax_scale, causal) -> (dq [T,H,Dn+Dr], dc_kv [T,Dc], dk_pe [T,Dr] (summed over heads),
    # dw_kv_up [H*(Dn+Dv),Dc])
    "mla_attention_bwd": "mla_attention_bwd(Tensor grad_out, Tensor q, Tensor c_kv, Tensor k_pe, "
                         "Tensor w_kv_up, Tensor out, Tensor lse, Tensor kv, Tensor cu_seqlens, "
                         "int max_seqlen, int num_heads, int qk_nope_dim, int v_dim, "
                         "float softmax_scale, bool causal) -> (Tensor, Tensor, Tensor, Tensor)",
    # grouped_gemm(x [M,K], weight [E,K,N] (trans_b: [E,N,K]), group_sizes [E] int32/int64,
    # trans_b) -> [M,N]: rows of group e are x[off_e : off_e + group_sizes[e]]; rows past
    # sum(group_sizes) are zero
    "grouped_gemm": "grouped_gemm(Tensor x, Tensor weight, Tensor group_sizes, bool trans_b) -> Tensor",
    # grouped_gemm_dw(a [M,P], b [M,Q], group_sizes [E]) -> [E,P,Q]: out[e] = a_e^T . b_e over the
    # rows of group e (zero for an empty group). The weight gradient of grouped_gemm: (x, dy) for
    # trans_b=False, (dy, x) for trans_b=True.
    "grouped_gemm_dw": "grouped_gemm_dw(Tensor a, Tensor b, Tensor group_sizes) -> Tensor",
}

LIBS: Dict[str, torch.library.Library] = {ns: torch.library.Library(ns, "DEF") for ns in NAMESPACES}
for _lib_ in LIBS.values():
    for _schema in SCHEMAS.values():
        _lib_.define(_schema)
_lib = LIBS[NAMESPACE]  # the public namespace's library (PrivateUse1 registrations in _npu.py)

# Internal fused kernels used by the framework adapters (ascend_moe_ops/integrations), not public
# ops: defined only for the native (C++) and reference namespaces. Their op modules call the native
# kernel where it is loaded (cpu) and the reference composition everywhere else.
INTERNAL_NAMESPACES = (BACKEND_NAMESPACES["native"], BACKEND_NAMESPACES["reference"])
INTERNAL_SCHEMAS = {
    # swiglu_probs(x [N,2F], probs [N]) -> [N,F] in x's dtype: silu(x[:, :F]) * x[:, F:] * probs[:, None]
    # in fp32, rounded once (Megatron-Core GroupedMLP's activation with the router probs)
    "swiglu_probs": "swiglu_probs(Tensor x, Tensor probs) -> Tensor",
    # -> (grad_x [N,2F] in x's dtype, grad_probs [N] in probs' dtype)
    "swiglu_probs_backward": "swiglu_probs_backward(Tensor grad_out, Tensor x, Tensor probs) -> (Tensor, Tensor)",
    # mask_permute(tokens [T,H], routing_map [T,E] bool, probs [T,E] or None, num_out_tokens (None, or
    # the routed count N)) -> (permuted_tokens [N,H], permuted_probs [N] (shape [0] without probs),
    # sorted_indices [N] int64, row_id_map [T,S] int32, expert_ids [T,S] int64 (S = most experts of a
    # token, -1 padded)): Megatron-Core's dropless permute (reference/megatron_paths.py)
    "mask_permute": "mask_permute(Tensor tokens, Tensor routing_map, Tensor? probs, int? num_out_tokens) "
                    "-> (Tensor, Tensor, Tensor, Tensor, Tensor)",
    # sort_chunks(input [N,...], split_sizes [C], sorted_idxs [C] (a permutation), probs [N,...] or None,
    # inverse) -> (output [N,...], permuted probs (shape [0] without probs)): Megatron-Core's
    # sort_chunks_by_idxs; inverse=True undoes it
    "sort_chunks": "sort_chunks(Tensor input, Tensor split_sizes, Tensor sorted_idxs, Tensor? probs, "
                   "bool inverse) -> (Tensor, Tensor)",
}
for _ns in INTERNAL_NAMESPACES:
    for _schema in INTERNAL_SCHEMAS.values():
        LIBS[_ns].define(_schema)

_INTERNAL_NATIVE = []  # [True] once the native kernels of the internal ops were found (it stays so)


def internal_native_loaded() -> bool:
    """Whether the C++ extension registered its kernels of the internal ops (one build registers
    all of them, so one is looked up)."""
    if not _INTERNAL_NATIVE:
        from . import _backends
        if not (_backends.load("native") is None and torch._C._dispatch_has_kernel_for_dispatch_key(
                f"{INTERNAL_NAMESPACES[0]}::mask_permute", "CPU")):
            return False
        _INTERNAL_NATIVE.append(True)
    return True


def internal_namespace_for(t) -> str:
    """The namespace an internal op runs in for tensor ``t``: native on cpu when loaded, else
    reference."""
    return INTERNAL_NAMESPACES[0] if t.device.type == "cpu" and internal_native_loaded() else INTERNAL_NAMESPACES[1]


def _native_autograd() -> frozenset:
    """The public ops whose autograd the C++ extension registers (its
    ``TORCH_LIBRARY_IMPL(ascend_moe_ops, Autograd, m)`` block runs when it is imported); empty when
    the extension is not built or does not load (``_backends.load("native")`` reports why)."""
    from . import _native  # checks the build record before importing (warns once on a mismatch)
    if _native.extension("ascend_moe_ops._C") is None:
        return frozenset()
    return frozenset(name for name in SCHEMAS
                     if torch._C._dispatch_has_kernel_for_dispatch_key(f"{NAMESPACE}::{name}", "Autograd"))


#: public ops whose autograd is the C++ kernel (``csrc/cpu/autograd.cpp``), not the Python formula
NATIVE_AUTOGRAD: frozenset = _native_autograd()


def op(name: str, ns: str = NAMESPACE):
    """``torch.ops.<ns>.<name>`` (default overload); ``ns`` defaults to the public namespace."""
    return getattr(getattr(torch.ops, ns), name).default


def ops_of(ns: str):
    """``name -> op`` for one namespace (what backward formulas and compositions call)."""
    return functools.partial(op, ns=ns)


# Python implementations of the Python backends: op -> (module, attribute), imported on first call.
PYTHON_IMPLS: Dict[str, Dict[str, tuple]] = {"reference": {}, "triton": {}}
# Python kernels of C++ backends' ops that are compositions in Python (MLA on the Ascend kernels):
# backend -> op -> factory(ns) returning the kernel for namespace ns.
COMPOSITE_KERNELS: Dict[str, Dict[str, Callable]] = {"ascendc-emu": {}}
# op -> contract check run by the Python kernels (full: metadata and values)
CHECKS: Dict[str, Callable] = {}
# op -> empty(*args): the outputs of a valid empty call (e.g. attention with T = 0 or H = 0) or None;
# the C++ kernels do the same after their check.
EMPTY: Dict[str, Callable] = {}


def register_op(name: str, *, fake: Callable, check_meta: Callable, check: Callable,
                backward: Optional[Callable] = None, setup_context: Optional[Callable] = None,
                empty: Optional[Callable] = None) -> None:
    """Register, for every namespace, the fake kernel of ``name`` (``check_meta`` first) and, when
    given, its autograd formula; ``backward(ops, ctx, *grads)`` gets the namespace's ``ops``. The
    public namespace gets the Python formula only when the C++ extension does not provide it
    (:data:`NATIVE_AUTOGRAD`)."""
    CHECKS[name] = check
    if empty is not None:
        EMPTY[name] = empty

    def fake_kernel(*args):
        check_meta(*args)
        return fake(*args)

    for ns in NAMESPACES:
        torch.library.register_fake(f"{ns}::{name}", fake_kernel, lib=LIBS[ns])
        if backward is not None and not (ns == NAMESPACE and name in NATIVE_AUTOGRAD):
            bwd = functools.partial(backward, ops_of(ns))
            torch.library.register_autograd(f"{ns}::{name}", bwd, setup_context=setup_context, lib=LIBS[ns])


def python_kernel(backend: str, name: str, ns: str) -> Callable:
    """The kernel of ``name`` for a Python backend: the op's contract check, then the
    implementation (imported on first call, so a missing toolkit only disables its backend)."""
    if name in COMPOSITE_KERNELS.get(backend, {}):
        return COMPOSITE_KERNELS[backend][name](ns)
    module, attr = PYTHON_IMPLS[backend][name]
    check, empty = CHECKS[name], EMPTY.get(name)
    state = {}

    def kernel(*args):
        check(*args)
        if backend == "triton":
            from . import _backends
            _backends.require_usable(backend, args)
        if empty is not None:
            out = empty(*args)
            if out is not None:
                return out
        fn = state.get("fn")
        if fn is None:
            fn = state["fn"] = getattr(importlib.import_module(module), attr)
        return fn(*args)

    kernel.__name__ = f"{name}_{backend.replace('-', '_')}"
    return kernel
