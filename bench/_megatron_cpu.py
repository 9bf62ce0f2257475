"""Running a real megatron-core ``MoELayer`` on CPU (world size 1, gloo), for bench_moe_layer.py and
the integration tests (``ascend_moe_ops.benchmark.suite._megatron_cpu``: shipped with the bench
suite, so the installed benchmarks import nothing from tests/).

Megatron-Core 0.16.1 has CPU obstacles of its own; they are worked around here, in test/bench code
only, never in the package (docs/integrations.md lists them):

1. ``MoEAlltoAllTokenDispatcher.__init__`` creates a ``torch.cuda.Stream()``, and its
   ``_maybe_dtoh_and_synchronize`` uses ``torch.cuda.current_stream()`` / ``torch.cuda.stream()`` /
   ``Stream.record_event()``: replaced by a do-nothing stream object while :func:`cpu_shims` is on.
2. ``Router.gating`` moves a CPU router weight to ``torch.cuda.current_device()`` (and the expert
   bias buffers are created there): ``current_device`` returns ``"cpu"`` under :func:`cpu_shims`.
3. ``moe_utils.RouterGatingLinearFunction`` reads the global ``te_general_gemm``, which is only
   defined when TransformerEngine imports (a ``NameError`` otherwise): set to ``None``.
4. Parameters are created on the GPU unless ``use_cpu_initialization=True`` (a config flag).
5. The model-parallel state needs a process group: gloo with world size 1 (or 2 for expert
   parallelism, :func:`megatron_world`).
6. With ``moe_permute_fusion=True`` the alltoall dispatcher's ``__init__`` puts its chunk-order
   indices on ``torch.device("cuda")``: :func:`make_layer` builds the layer with the flag off and
   turns it on afterwards (the config check itself runs with the flag on).
7. With expert parallelism (EP > 1) the alltoall dispatcher passes its split sizes to
   ``torch.distributed.all_to_all_single`` as the CPU tensors its ``maybe_move_tensor_to_cpu`` leaves
   in place (it converts only CUDA tensors, to numpy); gloo's binding wants integer sequences
   (``TypeError``): under :func:`cpu_shims` tensor split sizes are turned into lists first.
8. A whole ``GPTModel``: the core attention forks Megatron's CUDA RNG tracker (``get_cuda_rng_tracker()
   .fork()``, for attention dropout), whose states can only be added with CUDA: under
   :func:`cpu_shims` the tracker's ``fork`` is a do-nothing context (the CPU generator is used;
   the whole-model benchmark runs without dropout). Without an explicit attention mask the core
   attention builds its default causal mask on ``device="cuda"``: the benchmark passes one.
"""

from __future__ import annotations

import contextlib
import os
import socket
import warnings

import torch


class _NoStream:
    """Stands in for a CUDA stream/event on CPU (all work is synchronous there)."""

    def wait_stream(self, *a):
        pass

    def wait_event(self, *a):
        pass

    def record_event(self, *a):
        return self

    def synchronize(self):
        pass

    def query(self):
        return True


_STREAM = _NoStream()


@contextlib.contextmanager
def cpu_shims():
    """Megatron-Core's CUDA-only calls on the MoE path made harmless on CPU (see the module doc)."""
    from megatron.core.transformer.moe import moe_utils
    names = ("current_device", "Stream", "current_stream", "stream")
    saved = {n: getattr(torch.cuda, n) for n in names}
    had_te_gemm = "te_general_gemm" in vars(moe_utils)
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.Stream = lambda *a, **k: _STREAM
    torch.cuda.current_stream = lambda *a, **k: _STREAM
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    if not had_te_gemm:
        moe_utils.te_general_gemm = None
    import torch.distributed as dist
    a2a = dist.all_to_all_single

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, *a, **k):
        as_list = lambda s: s.tolist() if isinstance(s, torch.Tensor) else s  # noqa: E731
        return a2a(output, input, as_list(output_split_sizes), as_list(input_split_sizes), *a, **k)

    dist.all_to_all_single = all_to_all_single
    from megatron.core.tensor_parallel import random as tp_random
    tracker = tp_random.get_cuda_rng_tracker()
    had_fork = "fork" in vars(tracker)
    saved_fork = vars(tracker).get("fork")
    tracker.fork = lambda *a, **k: contextlib.nullcontext()
    try:
        yield
    finally:
        if had_fork:
            tracker.fork = saved_fork
        else:
            del tracker.fork
        dist.all_to_all_single = a2a
        for n, v in saved.items():
            setattr(torch.cuda, n, v)
        if not had_te_gemm:
            del moe_utils.te_general_gemm


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def megatron_world(rank=0, world_size=1, port=None):
    """A gloo process group and Megatron's parallel state on it (TP=PP=1, EP=world_size)."""
    import torch.distributed as dist
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core import parallel_state as ps
    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port or _free_port()}", rank=rank,
                                world_size=world_size)
    ps.initialize_model_parallel(1, 1, expert_model_parallel_size=world_size)
    try:
        yield
    finally:
        ps.destroy_model_parallel()
        if own:
            dist.destroy_process_group()


def make_layer(*, hidden=64, ffn=32, experts=8, topk=2, dispatcher="alltoall", grouped_gemm=False,
               dtype=torch.float32, capacity_factor=None, seed=0, **extra):
    """A real ``megatron.core.transformer.moe.moe_layer.MoELayer`` on CPU (SwiGLU experts, no
    shared expert, no aux loss). ``grouped_gemm=True`` builds ``GroupedMLP`` (Megatron allows it in
    bf16 only), else ``SequentialMLP``. ``capacity_factor`` turns on drop-and-pad."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer.moe.moe_layer import MoELayer
        from megatron.core.transformer.transformer_config import TransformerConfig
    kw = dict(num_layers=1, hidden_size=hidden, num_attention_heads=4, ffn_hidden_size=4 * hidden,
              moe_ffn_hidden_size=ffn, num_moe_experts=experts, moe_router_topk=topk,
              moe_token_dispatcher_type=dispatcher, use_cpu_initialization=True, gated_linear_unit=True,
              activation_func=torch.nn.functional.silu, add_bias_linear=False, moe_grouped_gemm=grouped_gemm,
              bf16=dtype == torch.bfloat16, params_dtype=dtype, moe_aux_loss_coeff=0.0)
    if capacity_factor is not None:
        kw.update(moe_expert_capacity_factor=capacity_factor, moe_pad_expert_input_to_capacity=True,
                  moe_token_drop_policy="probs")
    kw.update(extra)
    cfg = TransformerConfig(**kw)
    spec = get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=grouped_gemm)
    torch.manual_seed(seed)
    from ascend_moe_ops.integrations import megatron as mg
    # GroupedMLP asserts at construction that a grouped GEMM is importable: feed it this package's
    gg = mg.patched(targets=("grouped_gemm",)) if grouped_gemm else contextlib.nullcontext()
    cuda_index = cfg.moe_permute_fusion and dispatcher == "alltoall"  # obstacle 6 (module doc)
    cfg.moe_permute_fusion = cfg.moe_permute_fusion and not cuda_index
    with cpu_shims(), gg:
        layer = MoELayer(cfg, spec.submodules.mlp.submodules)
    cfg.moe_permute_fusion = cfg.moe_permute_fusion or cuda_index
    with torch.no_grad():  # Megatron's init leaves the router at zero-ish scale: give it real logits
        layer.router.weight.normal_(0, 1.0 / hidden ** 0.5, generator=torch.Generator().manual_seed(seed + 1))
    return layer


def run_layer(layer, x, grad_out):
    """Forward + backward: ``(output, {name: grad}, input grad)``. Grads are cleared first."""
    layer.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    with cpu_shims():
        out, _ = layer(x)
        out.backward(grad_out)
    grads = {n: p.grad.detach().clone() for n, p in layer.named_parameters() if p.grad is not None}
    return out.detach(), grads, x.grad.detach()
