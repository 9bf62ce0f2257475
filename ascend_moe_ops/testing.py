"""Test helpers shared by tests/ and bench/: the one tolerance table, and parity assertions against
the fp64 reference.

Rule for floats (the flash-attention rule): the fast path's max error against the fp64 reference
must be at most ``ERROR_FACTOR`` times the max error of the same computation done by PyTorch in the
same low precision, plus a small absolute floor from :data:`TOLERANCES` (which also bounds ops that
have no natural PyTorch low-precision counterpart). Index outputs must match exactly.
"""

from __future__ import annotations

from typing import Optional

import torch

ERROR_FACTOR = 2.0

# dtype -> (atol, rtol): the floor used together with the 2x rule, and the plain tolerance used
# when there is no low-precision PyTorch run to compare with. Data movement ops (permute) must be
# exact in every dtype; these only apply to arithmetic.
TOLERANCES = {
    torch.float64: (1e-12, 1e-10),
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-3, 1e-3),
    torch.bfloat16: (8e-3, 8e-3),
}

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def tolerance(dtype: torch.dtype):
    return TOLERANCES[dtype]


def max_abs_err(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    return (a.double() - b.double()).abs().max().item()


def assert_close_to_ref(out: torch.Tensor, ref64: torch.Tensor, *, dtype: Optional[torch.dtype] = None,
                        torch_lowp: Optional[torch.Tensor] = None, name: str = "output") -> None:
    """``out`` (any dtype) vs the fp64 reference ``ref64``.

    With ``torch_lowp`` (PyTorch's own result in the same low precision) the bound is
    ``ERROR_FACTOR * err(torch_lowp) + atol + rtol*|ref|``; without it, ``atol + rtol*|ref|``.
    NaN or inf where the reference is finite always fails.
    """
    dtype = dtype or out.dtype
    assert out.shape == ref64.shape, f"{name}: shape {tuple(out.shape)} != reference {tuple(ref64.shape)}"
    if out.numel() == 0:
        return
    o = out.double()
    r = ref64.double()
    finite = torch.isfinite(r)
    assert torch.isfinite(o[finite]).all(), f"{name}: non-finite values where the reference is finite"
    atol, rtol = TOLERANCES[dtype]
    bound = atol + rtol * r.abs()
    if torch_lowp is not None:
        bound = bound + ERROR_FACTOR * max_abs_err(torch_lowp, r)
    err = (o - r).abs()
    bad = err > bound
    if bad.any():
        i = torch.nonzero(bad)[0].tolist()
        raise AssertionError(
            f"{name} ({dtype}): max error {err.max().item():.3e}; first failure at {tuple(i)}: "
            f"{o[tuple(i)].item():.6g} vs reference {r[tuple(i)].item():.6g} (bound "
            f"{bound[tuple(i)].item() if bound.dim() else bound.item():.3e})")


def poison_like(t: torch.Tensor) -> torch.Tensor:
    """A tensor of NaNs shaped like ``t`` (to check that garbage never leaks into used rows)."""
    return torch.full_like(t, float("nan"))
