"""MoE layers built on the ops: :class:`GroupedMLP` (grouped-GEMM SwiGLU experts, Megatron-Core
parameter layout) and :class:`MoELayer` (router -> permute -> experts -> unpermute)."""

from .moe import GroupedMLP, MoELayer, SharedExpertMLP, TopKRouter, swiglu

__all__ = ["GroupedMLP", "MoELayer", "SharedExpertMLP", "TopKRouter", "swiglu"]
