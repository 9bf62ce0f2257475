"""ascend_moe_ops: fused MoE kernels and collectives (Pangu Ultra MoE recipe).

Every op runs on the pure-PyTorch reference with no compiled backend at all;
``active_backend(op, device)`` tells what really runs. Each backend is also reachable directly as
``torch.ops.<namespace>.<op>`` (``ascend_moe_ops_native``, ``_triton``, ``_emu``, ``_ref``).
"""

import sys as _sys

from . import _srctree
_srctree.install()  # ascend_moe_ops.triton_ref / .benchmark.suite in a source checkout

from . import _library  # noqa: F401,E402  (the backend records and the op registration)
from . import _backends  # noqa: E402
from ._backends import BackendUnavailableError, active_backend, available_backends, use_backend
from .formats import group_sizes_to_group_list, group_sizes_to_offsets
# The op modules: importing one defines its ops (docs/design.md, "Adding an op"). One line each.
from .ops.moe_permute import PermuteResult, moe_permute
from .ops.moe_unpermute import moe_unpermute
from .ops.grouped_gemm import grouped_gemm, grouped_gemm_dw
from .ops.flash_attention import flash_attention
from .ops.mla_attention import mla_attention
from .ops import swiglu_probs as _swiglu_probs  # noqa: F401,E402  (internal fused kernel of the adapters)
from .ops import megatron_paths as _megatron_paths  # noqa: F401,E402  (internal kernels of the Megatron adapter)
# (end of the op modules)
from . import nn  # noqa: E402  (MoE layers built on the ops)
from . import distributed  # noqa: E402  (EPTopology, MoEDispatcher: torch.distributed, not ops)
from . import balance  # noqa: E402  (load balancing: aux losses, expert placement)
from . import _npu  # noqa: E402  (AscendC NPU backend: loaded only when torch_npu is installed)

_backends.bind_public()  # once, after every op module: one kernel per dispatch key (CPU, CUDA)
_npu.load()  # PrivateUse1 kernels of the public namespace, when torch_npu and the NPU build exist

__version__ = "0.1.0"

__all__ = [
    "BackendUnavailableError", "active_backend", "available_backends", "use_backend",
    "group_sizes_to_offsets", "group_sizes_to_group_list",
    "nn", "distributed", "balance",
] + [name for _m in _library.op_modules(public=True) for name in _sys.modules[f"{__name__}.ops.{_m}"].__all__]
