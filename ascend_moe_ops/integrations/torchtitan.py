"""torchtitan integration: its MoE layer on this package's permute / grouped GEMM / unpermute.

Two torchtitan releases are supported, each through its own extension point (no trainer edit):

* **torchtitan 0.3.0** (the current release): the ``@override`` mechanism for hardware vendors.
  ``python -m torchtitan.train ... --override.imports ascend_moe_ops.integrations.torchtitan.ascend_moe``
  replaces, in the config tree before anything is built, every ``RoutedExperts`` config's
  ``GroupedExperts`` (exact class) by :class:`AscendGroupedExperts` -- torchtitan's own expert
  module whose grouped-mm hook ``_grouped_mm`` runs :func:`ascend_moe_ops.grouped_gemm` -- and its
  ``LocalTokenDispatcher`` / ``AllToAllTokenDispatcher`` by :class:`AscendTokenDispatcher`, which
  reorders with ``moe_permute`` / ``moe_unpermute`` when expert parallelism is off and keeps
  torchtitan's all-to-all when it is on. ``...torchtitan.ascend_grouped_mm`` swaps the experts only.
  0.3.0 has no ``--model.converters`` / ``--experimental.custom_import`` options any more: its
  model converters are Python config objects, and ``--override.imports`` imports this module.
* **torchtitan 0.2.2**: the model-converter registry. ``--experimental.custom_import
  ascend_moe_ops.integrations.torchtitan --model.converters ascend_moe_ops`` imports this module,
  which registers :class:`AscendMoEConverter` under ``"ascend_moe_ops"``; the trainer applies it to
  the model before parallelizing it (it calls :func:`patch_moe`).

:func:`patch_moe` / :func:`unpatch_moe` do the same on an already built model of either release
(instance attributes; the classes are untouched), before or after FSDP2's ``fully_shard``. Any
other torchtitan version is refused with the version found and what to install.

The weight converters at the top map torchtitan's expert layout (``w1 [E, F, H]`` gate, ``w3 [E, F,
H]`` up, ``w2 [E, H, F]`` down, ``h = silu(x @ w1[e].T) * (x @ w3[e].T)``, ``y = h @ w2[e].T``; the
same in both releases, named ``w1_EFD`` / ``w3_EFD`` / ``w2_EDF`` in 0.3.0) to
:class:`~ascend_moe_ops.nn.GroupedMLP`'s two ``[in, out]`` tensors (``weight1 [H, E*2F]`` with the
gate half first, ``weight2 [E*F, H]``) and back, exactly (pure copies).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from dataclasses import dataclass
from typing import Tuple

import torch

from ..nn.moe import GroupedMLP

Tensor = torch.Tensor

__all__ = ["from_torchtitan_weights", "to_torchtitan_weights", "load_torchtitan_weights",
           "patch_moe", "unpatch_moe", "is_patched", "call_counts", "torchtitan_version",
           "SUPPORTED_VERSIONS", "CONVERTER_NAME", "register", "ascend_moe", "ascend_grouped_mm"]


def _check(w1: Tensor, w2: Tensor, w3: Tensor) -> Tuple[int, int, int]:
    for name, w in (("w1", w1), ("w2", w2), ("w3", w3)):
        if not isinstance(w, torch.Tensor) or w.dim() != 3:
            shape = tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__
            raise ValueError(f"{name} must be a 3-D tensor, got {shape}")
        if not w.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {w.dtype}")
    E, F, H = w1.shape
    if tuple(w3.shape) != (E, F, H):
        raise ValueError(f"w3 must have the shape of w1 {(E, F, H)} ([E, F, H]), got {tuple(w3.shape)}")
    if tuple(w2.shape) != (E, H, F):
        raise ValueError(f"w2 must have shape {(E, H, F)} ([E, H, F] for w1 {(E, F, H)}), got {tuple(w2.shape)}")
    if not (w1.dtype == w2.dtype == w3.dtype):
        raise ValueError(f"w1, w2, w3 must share a dtype, got {w1.dtype}, {w2.dtype}, {w3.dtype}")
    return E, F, H


def _check_mlp(mlp) -> None:
    if not isinstance(mlp, GroupedMLP):
        raise TypeError(f"mlp must be an ascend_moe_ops.nn.GroupedMLP, got {type(mlp).__name__}")


@torch.no_grad()
def load_torchtitan_weights(mlp: GroupedMLP, w1: Tensor, w2: Tensor, w3: Tensor) -> GroupedMLP:
    """Copy torchtitan's ``(w1, w2, w3)`` into an existing :class:`GroupedMLP`; returns it."""
    _check_mlp(mlp)
    E, F, H = _check(w1, w2, w3)
    if (mlp.num_experts, mlp.ffn_hidden_size, mlp.hidden_size) != (E, F, H):
        raise ValueError(f"GroupedMLP has E={mlp.num_experts}, F={mlp.ffn_hidden_size}, H={mlp.hidden_size}; "
                         f"the torchtitan weights have E={E}, F={F}, H={H}")
    fc1 = mlp.w1()  # [E, H, 2F]
    fc1[:, :, :F].copy_(w1.transpose(1, 2))
    fc1[:, :, F:].copy_(w3.transpose(1, 2))
    mlp.w2().copy_(w2.transpose(1, 2))  # [E, F, H]
    return mlp


def from_torchtitan_weights(w1: Tensor, w2: Tensor, w3: Tensor, **kwargs) -> GroupedMLP:
    """A new :class:`GroupedMLP` (dtype/device of ``w1``) holding torchtitan's expert weights."""
    E, F, H = _check(w1, w2, w3)
    mlp = GroupedMLP(E, H, F, dtype=w1.dtype, device=w1.device, **kwargs)
    return load_torchtitan_weights(mlp, w1, w2, w3)


@torch.no_grad()
def to_torchtitan_weights(mlp: GroupedMLP) -> Tuple[Tensor, Tensor, Tensor]:
    """``(w1 [E, F, H], w2 [E, H, F], w3 [E, F, H])`` copies of a :class:`GroupedMLP`'s weights."""
    _check_mlp(mlp)
    F = mlp.ffn_hidden_size
    fc1 = mlp.w1()
    w1 = fc1[:, :, :F].transpose(1, 2).contiguous()
    w3 = fc1[:, :, F:].transpose(1, 2).contiguous()
    w2 = mlp.w2().transpose(1, 2).contiguous()
    return w1, w2, w3



# ---------------------------------------------------------------------------------------------
# Versions
# ---------------------------------------------------------------------------------------------

#: the torchtitan releases this module knows, newest first (the first is the one to install)
SUPPORTED_VERSIONS = ("0.3.0", "0.2.2")
#: the name :class:`AscendMoEConverter` is registered under (torchtitan 0.2.2 ``--model.converters``)
CONVERTER_NAME = "ascend_moe_ops"
_INSTALL = f"pip install torchtitan=={SUPPORTED_VERSIONS[0]}"


def torchtitan_version() -> str:
    """The version of the importable torchtitan (``torchtitan.__version__``, else its metadata).

    Raises ``RuntimeError`` naming what to install when torchtitan cannot be imported."""
    try:
        import torchtitan
    except Exception as exc:
        raise RuntimeError(f"torchtitan cannot be imported ({type(exc).__name__}: {exc}); this "
                           f"integration supports torchtitan {' and '.join(SUPPORTED_VERSIONS)}: "
                           f"{_INSTALL}") from exc
    version = getattr(torchtitan, "__version__", None)
    if not version or version == "0.0.0":
        import importlib.metadata
        try:
            version = importlib.metadata.version("torchtitan")
        except importlib.metadata.PackageNotFoundError:
            version = "unknown"
    return str(version)


def _require_supported() -> str:
    version = torchtitan_version()
    if version not in SUPPORTED_VERSIONS:
        raise RuntimeError(
            f"torchtitan {version} is installed; ascend_moe_ops.integrations.torchtitan supports "
            f"torchtitan {' and '.join(SUPPORTED_VERSIONS)} only (their MoE modules and extension "
            f"points differ between releases): {_INSTALL}")
    return version


#: calls into the package through the patched torchtitan modules, by op
call_counts = {"moe_permute": 0, "moe_unpermute": 0, "grouped_gemm": 0}

_MARK = "_ascend_moe_ops_patched"
_EP_TP_DIMS = frozenset({"ep", "tp", "etp"})


def _sharded_dims(weights) -> list:
    """Mesh dimension names of DTensor ``weights`` that shard experts for EP / TP (``[]`` for
    plain tensors and for FSDP2-sharded ones, which FSDP2 gathers before the experts run)."""
    dims = set()
    for w in weights:
        if type(w).__name__ == "DTensor":
            names = w.device_mesh.mesh_dim_names or ()
            dims.update(n for n in names if n in _EP_TP_DIMS)
    return sorted(dims)


def _no_dtensor_at_run(weights) -> None:
    if any(type(w).__name__ == "DTensor" for w in weights):
        raise RuntimeError(
            "the expert weights are still sharded DTensors when the experts run: FSDP2 gathers "
            "them only when the module it wraps runs, so fully_shard the MoE layer, its experts "
            "module or a module holding them (torchtitan's own order) -- patching may come before "
            "or after fully_shard")


def _grouped_gemm(x: Tensor, w: Tensor, sizes: Tensor) -> Tensor:
    """``x[rows of e] @ w[e].T`` (``w`` in nn.Linear layout ``[E, out, in]``)."""
    import ascend_moe_ops as amo
    call_counts["grouped_gemm"] += 1
    return amo.grouped_gemm(x, w, sizes, trans_b=True)


# ---------------------------------------------------------------------------------------------
# torchtitan 0.2.2: torchtitan.models.moe.moe.MoE, the model-converter registry
# ---------------------------------------------------------------------------------------------

_NEEDED_022 = ("router", "reorderer", "experts", "shared_experts", "score_before_experts",
               "expert_bias", "tokens_per_expert")


def _check_moe_022(m) -> None:
    missing = [a for a in _NEEDED_022 if not hasattr(m, a)]
    missing += [f"experts.{a}" for a in ("w1", "w2", "w3", "num_experts") if not hasattr(m.experts, a)]
    missing += [f"router.{a}" for a in ("top_k",) if not hasattr(m.router, a)]
    if missing:
        raise RuntimeError(f"refusing to patch {type(m).__name__}: attributes {missing} not found "
                           "(torchtitan 0.2.2's MoE layout expected)")
    dims = _sharded_dims((m.experts.w1, m.experts.w2, m.experts.w3))
    if dims:
        raise RuntimeError(f"refusing to patch: the expert weights are sharded over the mesh "
                           f"dimension(s) {dims} (expert/tensor parallelism), which this swap does "
                           "not support with torchtitan 0.2.2; FSDP2 sharding is fine")


def _experts_forward_022(self, x: Tensor, num_tokens_per_expert: Tensor) -> Tensor:
    """``GroupedExperts.forward`` of torchtitan 0.2.2 on the package's grouped GEMM."""
    _no_dtensor_at_run((self.w1, self.w2, self.w3))
    h = torch.nn.functional.silu(_grouped_gemm(x, self.w1, num_tokens_per_expert))
    h = h * _grouped_gemm(x, self.w3, num_tokens_per_expert)
    return _grouped_gemm(h, self.w2, num_tokens_per_expert)


def _moe_forward_022(self, x: Tensor) -> Tensor:
    """torchtitan 0.2.2 ``MoE.forward`` with the package's permute / grouped GEMM / unpermute."""
    import ascend_moe_ops as amo
    bs, slen, dim = x.shape
    x = x.view(-1, dim)
    top_scores, selected, num_tokens_per_expert = self.router(x, self.expert_bias)
    with torch.no_grad():
        self.tokens_per_expert.add_(num_tokens_per_expert)
    E = self.experts.num_experts
    call_counts["moe_permute"] += 1
    if self.score_before_experts:
        res = amo.moe_permute(x, selected, top_scores, num_experts=E, num_out_tokens=selected.numel(),
                              map_type="index")
        routed = (res.tokens.to(torch.float32) * res.probs.reshape(-1, 1)).to(x.dtype)
    else:
        res = amo.moe_permute(x, selected, num_experts=E, num_out_tokens=selected.numel(),
                              map_type="index")
        routed = res.tokens
    # a module call, as torchtitan's forward makes: FSDP2's hooks on the experts module run
    routed_out = self.experts(routed, res.group_sizes)
    out = self.shared_experts(x) if self.shared_experts is not None else None
    call_counts["moe_unpermute"] += 1
    if self.score_before_experts:
        out_experts = amo.moe_unpermute(routed_out, res.row_id_map)
    else:
        out_experts = amo.moe_unpermute(routed_out, res.row_id_map, top_scores)
    out_experts = out_experts.to(x.dtype)
    if out is None:
        return out_experts.reshape(bs, slen, dim)
    return (out + out_experts).reshape(bs, slen, dim)


def _patch_022(targets) -> int:
    for m in targets:
        _check_moe_022(m)
    n = 0
    for m in targets:
        if not getattr(m, _MARK, False):
            m.forward = _moe_forward_022.__get__(m, type(m))
            m.experts.forward = _experts_forward_022.__get__(m.experts, type(m.experts))
            setattr(m, _MARK, True)
            n += 1
    return n


def _unpatch_022(m) -> None:
    del m.forward
    del m.experts.forward


class AscendMoEConverter:
    """torchtitan 0.2.2 model converter (``--model.converters ascend_moe_ops``): :func:`patch_moe`
    on the model the trainer builds, before it parallelizes it."""

    def __init__(self, job_config, parallel_dims):
        dims = [n for n in ("ep", "tp", "etp") if getattr(parallel_dims, f"{n}_enabled", False)]
        if dims:
            raise RuntimeError(f"model converter {CONVERTER_NAME!r}: {'/'.join(dims)} parallelism "
                               "is on; with torchtitan 0.2.2 the swap supports FSDP2 and data "
                               "parallelism only (torchtitan 0.3.0's override supports EP)")

    def convert(self, model) -> None:
        n = patch_moe(model)
        from torchtitan.tools.logging import logger
        logger.info(f"{CONVERTER_NAME}: {n} MoE layer(s) on moe_permute / grouped_gemm / moe_unpermute")

    def post_optimizer_hook(self, model) -> None:
        return None


# ---------------------------------------------------------------------------------------------
# torchtitan 0.3.0: torchtitan.models.common.moe, the @override mechanism and the grouped-mm hook
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _PermuteMetadata:
    """What :class:`AscendTokenDispatcher`'s local ``dispatch`` hands to its ``combine``."""
    row_id_map: Tensor
    topk_scores: Tensor


def _grouped_mm_030(self, *, A: Tensor, B_t: Tensor, offs: Tensor) -> Tensor:
    """torchtitan 0.3.0's ``GroupedExperts._grouped_mm`` hook: ``A @ B_t`` per expert, with the
    per-expert ends ``offs`` (int32 cumulative counts), on the package's grouped GEMM."""
    sizes = torch.diff(offs, prepend=offs.new_zeros(1))
    return _grouped_gemm(A, B_t.transpose(-2, -1), sizes)


def _dispatch_030(self, x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E):
    """Local (EP=1) dispatch of torchtitan 0.3.0 with ``moe_permute``: the rows in torchtitan's
    order (stable by expert), the per-expert counts, the row map for ``combine``."""
    import ascend_moe_ops as amo
    if getattr(self, "ep_mesh", None) is not None:  # expert parallel: torchtitan's all-to-all
        return type(self).dispatch(self, x_TD, topk_scores_TK, topk_expert_ids_TK,
                                   num_local_tokens_per_expert_E)
    call_counts["moe_permute"] += 1
    res = amo.moe_permute(x_TD, topk_expert_ids_TK, num_experts=self.num_experts,
                          num_out_tokens=topk_expert_ids_TK.numel(), map_type="index")
    return res.tokens, res.group_sizes, _PermuteMetadata(res.row_id_map, topk_scores_TK)


def _combine_030(self, routed_output_RD, metadata, x_TD):
    """``combine`` of torchtitan 0.3.0 with ``moe_unpermute`` (scores applied in fp32)."""
    import ascend_moe_ops as amo
    if not isinstance(metadata, _PermuteMetadata):
        return type(self).combine(self, routed_output_RD, metadata, x_TD)
    call_counts["moe_unpermute"] += 1
    out = amo.moe_unpermute(routed_output_RD, metadata.row_id_map, metadata.topk_scores)
    return out.to(x_TD.dtype)


_V030 = {}


def _v030():
    """torchtitan 0.3.0's classes and this package's subclasses of them (built once)."""
    if _V030:
        return _V030
    from torchtitan.models.common import moe as tmoe
    from torchtitan.models.common import token_dispatcher as ttd

    class AscendGroupedExperts(tmoe.GroupedExperts):
        """torchtitan's ``GroupedExperts`` (same parameters, same forward) whose grouped-mm hook
        runs :func:`ascend_moe_ops.grouped_gemm`."""

        @dataclass(kw_only=True, slots=True)
        class Config(tmoe.GroupedExperts.Config):
            pass

        _grouped_mm = _grouped_mm_030

    class AscendTokenDispatcher(ttd.AllToAllTokenDispatcher):
        """torchtitan's ``AllToAllTokenDispatcher``: without expert parallelism (no EP mesh) the
        tokens are reordered by ``moe_permute`` and combined by ``moe_unpermute``; with it,
        torchtitan's all-to-all dispatch and combine run unchanged."""

        @dataclass(kw_only=True, slots=True)
        class Config(ttd.AllToAllTokenDispatcher.Config):
            pass

        def dispatch(self, x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E):
            if self.ep_mesh is not None:
                return super().dispatch(x_TD, topk_scores_TK, topk_expert_ids_TK,
                                        num_local_tokens_per_expert_E)
            return _dispatch_030(self, x_TD, topk_scores_TK, topk_expert_ids_TK,
                                 num_local_tokens_per_expert_E)

        def combine(self, routed_output_RD, metadata, x_TD):
            if not isinstance(metadata, _PermuteMetadata):
                return super().combine(routed_output_RD, metadata, x_TD)
            return _combine_030(self, routed_output_RD, metadata, x_TD)

    for cls in (AscendGroupedExperts, AscendTokenDispatcher):
        cls.__module__, cls.__qualname__ = __name__, cls.__name__
        cls.Config.__module__, cls.Config.__qualname__ = __name__, f"{cls.__name__}.Config"
    _V030.update(moe=tmoe, dispatchers=ttd, AscendGroupedExperts=AscendGroupedExperts,
                 AscendTokenDispatcher=AscendTokenDispatcher)
    return _V030


def _experts_config_030(cfg):
    from torchtitan.config import derive
    v = _v030()
    if type(cfg) is not v["moe"].GroupedExperts.Config:  # e.g. a quantized subclass: keep it
        return cfg
    return derive(cfg, v["AscendGroupedExperts"].Config)


def _dispatcher_config_030(cfg):
    from torchtitan.config import derive
    v = _v030()
    ttd = v["dispatchers"]
    if type(cfg) not in (ttd.LocalTokenDispatcher.Config, ttd.AllToAllTokenDispatcher.Config):
        return cfg  # DeepEP / HybridEP / ...: torchtitan's own
    return derive(cfg, v["AscendTokenDispatcher"].Config)


def ascend_moe(cfg):
    """torchtitan 0.3.0 ``@override`` of ``RoutedExperts.Config``: the package's grouped GEMM for
    the experts and its permute / unpermute for the local dispatch (torchtitan's all-to-all kept
    under expert parallelism). Activate with ``--override.imports
    ascend_moe_ops.integrations.torchtitan.ascend_moe``."""
    import dataclasses
    return dataclasses.replace(cfg, inner_experts=_experts_config_030(cfg.inner_experts),
                               token_dispatcher=_dispatcher_config_030(cfg.token_dispatcher))


def ascend_grouped_mm(cfg):
    """torchtitan 0.3.0 ``@override`` of ``GroupedExperts.Config`` (that exact class): only the
    grouped-mm hook, with any token dispatcher. ``--override.imports
    ascend_moe_ops.integrations.torchtitan.ascend_grouped_mm``."""
    return _experts_config_030(cfg)


def _check_moe_030(m) -> None:
    re = getattr(m, "routed_experts", None)
    ex, disp = getattr(re, "inner_experts", None), getattr(re, "token_dispatcher", None)
    missing = [n for n, o in (("routed_experts.inner_experts", ex),
                              ("routed_experts.token_dispatcher", disp)) if o is None]
    if ex is not None:
        missing += [f"inner_experts.{a}" for a in ("w1_EFD", "w2_EDF", "w3_EFD", "_grouped_mm")
                    if not hasattr(ex, a)]
    if missing:
        raise RuntimeError(f"refusing to patch {type(m).__name__}: attributes {missing} not found "
                           "(torchtitan 0.3.0's MoE layout expected)")


def _patch_030(targets) -> int:
    for m in targets:
        _check_moe_030(m)
    v = _v030()
    n = 0
    for m in targets:
        if getattr(m, _MARK, False):
            continue
        ex, disp = m.routed_experts.inner_experts, m.routed_experts.token_dispatcher
        # a subclass with its own grouped mm (quantized experts) or one of ours keeps it
        if getattr(type(ex), "_grouped_mm", None) is v["moe"].GroupedExperts._grouped_mm:
            ex._grouped_mm = _grouped_mm_030.__get__(ex, type(ex))
        if type(disp) in (v["dispatchers"].LocalTokenDispatcher,
                          v["dispatchers"].AllToAllTokenDispatcher):
            disp.dispatch = _dispatch_030.__get__(disp, type(disp))
            disp.combine = _combine_030.__get__(disp, type(disp))
        setattr(m, _MARK, True)
        n += 1
    return n


def _unpatch_030(m) -> None:
    ex, disp = m.routed_experts.inner_experts, m.routed_experts.token_dispatcher
    for obj, names in ((ex, ("_grouped_mm",)), (disp, ("dispatch", "combine"))):
        for name in names:
            obj.__dict__.pop(name, None)


# ---------------------------------------------------------------------------------------------
# Either release: one call on a built model, and the registration with torchtitan
# ---------------------------------------------------------------------------------------------

def _moe_class(version: str):
    path = "torchtitan.models.common.moe" if version == "0.3.0" else "torchtitan.models.moe.moe"
    try:
        return importlib.import_module(path).MoE
    except Exception as exc:  # pragma: no cover - depends on the environment
        raise RuntimeError(f"torchtitan {version}'s MoE module {path} cannot be imported: "
                           f"{type(exc).__name__}: {exc}") from exc


def _targets(module, version: str):
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module must be a torch.nn.Module (a torchtitan model or MoE), got {type(module).__name__}")
    MoE = _moe_class(version)
    return [m for m in module.modules() if isinstance(m, MoE)]


def patch_moe(module) -> int:
    """Make torchtitan's ``MoE`` (``module`` itself or every one inside it) use this package's ops.

    torchtitan 0.2.2: an instance-level ``forward`` on each ``MoE`` and its experts module.
    torchtitan 0.3.0: instance-level ``_grouped_mm`` on each ``GroupedExperts`` (its grouped-mm
    hook) and ``dispatch`` / ``combine`` on each local / all-to-all token dispatcher (torchtitan's
    all-to-all kept when an EP mesh is wired). The classes and other instances are untouched.
    Works before or after FSDP2's ``fully_shard``. Idempotent; returns the number of MoE modules
    newly patched. Raises ``RuntimeError`` (nothing changed) for an unsupported torchtitan version
    (naming it and what to install), a module without the release's layout, or (0.2.2) expert
    weights sharded for expert/tensor parallelism; ``ValueError`` when ``module`` holds no MoE.
    """
    version = _require_supported()
    targets = _targets(module, version)
    if not targets:
        raise ValueError(f"module: no torchtitan {version} MoE found in {type(module).__name__}")
    return (_patch_030 if version == "0.3.0" else _patch_022)(targets)


def unpatch_moe(module) -> int:
    """Undo :func:`patch_moe` on ``module`` (and every MoE inside it); returns how many were restored."""
    version = _require_supported()
    n = 0
    for m in _targets(module, version):
        if getattr(m, _MARK, False):
            (_unpatch_030 if version == "0.3.0" else _unpatch_022)(m)
            delattr(m, _MARK)
            n += 1
    return n


def is_patched(module) -> bool:
    return bool(getattr(module, _MARK, False))


def __getattr__(name):
    """``AscendGroupedExperts`` / ``AscendTokenDispatcher`` (torchtitan 0.3.0 only)."""
    if name in ("AscendGroupedExperts", "AscendTokenDispatcher"):
        if _require_supported() != "0.3.0":
            raise AttributeError(f"{name} exists with torchtitan 0.3.0 only")
        return _v030()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_REGISTERED = []


def register() -> str:
    """Register this package with the installed torchtitan; returns its version.

    0.3.0: the ``@override`` factories :func:`ascend_moe` and :func:`ascend_grouped_mm`.
    0.2.2: :class:`AscendMoEConverter` as model converter ``"ascend_moe_ops"``. Idempotent. Runs
    when this module is imported with torchtitan installed (how ``--override.imports`` and
    ``--experimental.custom_import`` load it). Raises ``RuntimeError`` for another version."""
    version = _require_supported()
    if _REGISTERED:
        return version
    if version == "0.3.0":
        from torchtitan.config import override
        from torchtitan.models.common.moe import GroupedExperts, RoutedExperts
        for fn, target, exact, what in (
                (ascend_moe, RoutedExperts.Config, False, "grouped GEMM experts and permute/unpermute dispatch"),
                (ascend_grouped_mm, GroupedExperts.Config, True, "grouped GEMM experts")):
            try:
                override(target=target, exact=exact, description=f"ascend_moe_ops: {what}")(fn)
            except ValueError as exc:  # registered by an earlier import of this module
                if "already registered" not in str(exc):
                    raise
    else:
        from torchtitan.protocols import model_converter
        if CONVERTER_NAME not in getattr(model_converter, "_registry_model_converter_cls", {}):
            model_converter.register_model_converter(AscendMoEConverter, CONVERTER_NAME)
    _REGISTERED.append(version)
    return version


def _register_on_import() -> None:
    if importlib.util.find_spec("torchtitan") is None:
        return  # the weight converters need no torchtitan
    try:
        register()
    except RuntimeError:
        # loaded by torchtitan's trainer (--override.imports / --experimental.custom_import): say
        # now that the version is wrong; otherwise patch_moe / register say it when called
        if any(name in sys.modules for name in ("torchtitan.train", "torchtitan.trainer")):
            raise


_register_on_import()
