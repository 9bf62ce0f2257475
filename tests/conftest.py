"""Shared pytest setup.

* Without a GPU, Triton kernels run in the interpreter (``TRITON_INTERPRET=1``), which must be set
  before triton is imported.
* ``backends(op)`` lists the backends that can run ``op`` on cpu in this process; tests parametrize
  over it. Each backend is its own dispatcher namespace (``namespace(backend)``,
  ``ops_of(backend)(op)`` = ``torch.ops.<namespace>.<op>.default``); ``namespaces(op)`` gives
  ``pytest.param(namespace, id=backend)`` for parametrizing direct op calls. The backends named in ``ASCEND_MOE_OPS_REQUIRE`` (default ``native,triton,ascendc-emu``, the ones a
  normal install builds) must load for every op that has them, so a broken build fails the suite
  instead of silently shortening the test matrix. ``ASCEND_MOE_OPS_REQUIRE=`` relaxes that.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import ascend_moe_ops  # noqa: E402
from ascend_moe_ops import _backends, _library  # noqa: E402

DEVICE = "cpu"


def backends(op: str):
    return [b for b in _backends.BACKENDS if b in _backends.available_backends(op, DEVICE)]


def namespace(backend: str) -> str:
    return _library.BACKEND_NAMESPACES[backend]


def ops_of(backend: str):
    """``ops_of(backend)(op)`` is ``torch.ops.<namespace of backend>.<op>.default``."""
    return _library.ops_of(namespace(backend))


def namespaces(op: str):
    return [pytest.param(namespace(b), id=b) for b in backends(op)]


def attention_parity_grid(op: str, dtypes):
    """The parametrization of the attention parity tests: every backend of ``op`` x ``dtypes`` x
    causal / full x batch / varlen layout. The test is skipped for the reference in low precision
    (it is the comparison itself): call :func:`skip_reference_lowp` first."""
    marks = [pytest.mark.parametrize("backend", backends(op)),
             pytest.mark.parametrize("dtype", dtypes, ids=str),
             pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"]),
             pytest.mark.parametrize("layout", ["batch", "varlen"])]

    def apply(fn):
        for mark in reversed(marks):  # as if written top to bottom above ``fn``
            fn = mark(fn)
        return fn

    return apply


def skip_reference_lowp(backend: str, dtype) -> None:
    if backend == "reference" and dtype != torch.float32:
        pytest.skip("the reference in low precision is the comparison itself")


def required_backends():
    return [b for b in os.environ.get("ASCEND_MOE_OPS_REQUIRE", "native,triton,ascendc-emu").split(",") if b]


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: larger shapes; deselect with -m 'not slow'")
    config.addinivalue_line("markers", "npu: needs an Ascend NPU with torch_npu (skipped elsewhere)")
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped elsewhere)")


def pytest_collection_modifyitems(config, items):
    have_npu = False
    try:
        import importlib.util
        have_npu = importlib.util.find_spec("torch_npu") is not None
    except Exception:
        pass
    for item in items:
        if "npu" in item.keywords and not have_npu:
            item.add_marker(pytest.mark.skip(reason="no Ascend NPU / torch_npu on this machine"))
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason="no CUDA GPU on this machine"))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
