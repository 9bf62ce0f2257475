"""Adapters that give the ops the calling conventions of training frameworks.

* :mod:`ascend_moe_ops.integrations.megatron`: ``permute`` / ``unpermute`` with the arguments and
  return values of Megatron-Core's ``megatron.core.transformer.moe.moe_utils.permute/unpermute``.

Adapters are imported on demand (``from ascend_moe_ops.integrations import megatron``); none of
them needs the framework itself to be installed.
"""
