import os

import pytest
import torch

import ascend_moe_ops as amo
from ascend_moe_ops import _backends
from conftest import required_backends

OPS = sorted({op for op, _ in _backends._IMPLS})


@pytest.mark.parametrize("op", OPS)
def test_required_backends_load(op):
    missing = {b: _backends.unavailable_reason(op, b) for b in required_backends()
               if (op, b) in _backends._IMPLS and b not in _backends.available_backends(op, "cpu")}
    assert not missing, f"{op}: required backends unavailable: {missing}"


def test_reference_always_available():
    for op in OPS:
        assert "reference" in _backends.available_backends(op, "cpu")


def test_forced_backend_is_reported_and_unknown_rejected(monkeypatch):
    monkeypatch.setenv(_backends.ENV_VAR, "reference")
    assert amo.active_backend("moe_permute", "cpu") == "reference"
    monkeypatch.setenv(_backends.ENV_VAR, "bogus")
    with pytest.raises(ValueError, match="ASCEND_MOE_OPS_BACKEND"):
        amo.active_backend("moe_permute", "cpu")


def test_forced_backend_that_cannot_run_raises(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with amo.use_backend("triton"):
        with pytest.raises(amo.BackendUnavailableError, match="triton"):
            amo.moe_permute(torch.randn(2, 3), torch.zeros(2, 1, dtype=torch.int64), num_experts=1)


def test_use_backend_context_overrides_env(monkeypatch):
    monkeypatch.setenv(_backends.ENV_VAR, "native")
    with amo.use_backend("reference"):
        assert amo.active_backend("moe_unpermute", "cpu") == "reference"
