"""Runnable examples built only from the package's modules.

* :mod:`ascend_moe_ops.examples.pretrain` — a scaled-down Pangu Ultra MoE (MLA attention, routed +
  shared experts, top-k, EP-group auxiliary loss, dropless) trained on byte-level text of the
  Python standard library, on one process or on gloo processes emulating ``nodes x ranks`` with
  the hierarchical dispatcher, chunked overlap, KV recompute and dynamic expert placement::

      python -m ascend_moe_ops.examples.pretrain --steps 200
      python -m ascend_moe_ops.examples.pretrain --steps 200 --procs 4 --local-size 2
"""
