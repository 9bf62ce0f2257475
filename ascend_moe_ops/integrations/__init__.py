"""Adapters that give the ops the calling conventions of training frameworks.

* :mod:`ascend_moe_ops.integrations.megatron`: ``permute`` / ``unpermute`` /
  ``sort_chunks_by_idxs`` with the arguments and return values of Megatron-Core's ``moe_utils``,
  and ``patch()`` / ``unpatch()`` / ``patched()``, which make an unmodified Megatron-Core MoE layer
  use them (and the grouped GEMM below) with one call.
* :mod:`ascend_moe_ops.integrations.grouped_gemm`: a stand-in for the ``grouped_gemm`` package
  (``ops.gmm``, ``backend.gmm``) that Megatron-Core's ``GroupedMLP`` calls.
* :mod:`ascend_moe_ops.integrations.torchtitan`: torchtitan 0.3.0's ``@override`` factories
  (``--override.imports ascend_moe_ops.integrations.torchtitan.ascend_moe``), torchtitan 0.2.2's
  model converter (``--model.converters ascend_moe_ops``), ``patch_moe()`` for a built model of
  either, and torchtitan ``w1/w2/w3`` expert weights <-> :class:`ascend_moe_ops.nn.GroupedMLP`.

Adapters are imported on demand (``from ascend_moe_ops.integrations import megatron``); none of
them needs the framework to be installed (``patch()`` does). See docs/integrations.md.
"""
