"""ascend_moe_ops.formats: group_sizes -> grouped_mm offsets and torch_npu group_list.

The offsets are checked the way they are used: ``torch.nn.functional.grouped_mm`` /
``torch._grouped_mm`` (2-D tokens x 3-D weights) over ``moe_permute``'s output must equal a
per-expert loop of plain matmuls. (Those kernels leave rows past ``offs[-1]`` unwritten, so only
the used rows are compared.)
"""

import re

import pytest
import torch

import ascend_moe_ops as amo
from ascend_moe_ops.formats import group_sizes_to_group_list, group_sizes_to_offsets

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
MODES = [dict(), dict(align=4), dict(capacity=5)]
MODE_IDS = ["dropless", "align4", "capacity5"]
GROUPED_MMS = [pytest.param(getattr(torch.nn.functional, "grouped_mm", None), id="F.grouped_mm"),
               pytest.param(getattr(torch, "_grouped_mm", None), id="torch._grouped_mm")]


def _permuted(dtype, mode, T=40, H=32, E=6, K=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randn(T, H, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    ids[ids == 3] = 4  # expert 3 gets no tokens: a zero-size group
    probs = torch.rand(T, K, generator=g)
    return amo.moe_permute(tokens, ids, probs, num_experts=E, **mode, map_type="index")


def _loop_mm(x, w, group_sizes):
    """Reference: one matmul per expert over its rows, in fp32, rounded once."""
    outs, start = [], 0
    for e, n in enumerate(group_sizes.tolist()):
        outs.append(x[start:start + n].float() @ w[e].float())
        start += n
    return torch.cat(outs).to(x.dtype), start


def test_offsets_values_and_dtype():
    for dt in (torch.int32, torch.int64):
        gs = torch.tensor([3, 0, 5, 1], dtype=dt)
        offs = group_sizes_to_offsets(gs)
        assert offs.dtype == torch.int32 and offs.shape == (4,)
        assert offs.tolist() == [3, 3, 8, 9]
    assert group_sizes_to_offsets(torch.zeros(0, dtype=torch.int64)).shape == (0,)


@pytest.mark.parametrize("grouped_mm", GROUPED_MMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_offsets_drive_grouped_mm(grouped_mm, dtype, mode):
    if grouped_mm is None:
        pytest.skip("this torch has no grouped_mm")
    res = _permuted(dtype, mode)
    E, H, N = res.group_sizes.numel(), res.tokens.shape[1], 16
    w = torch.randn(E, H, N).to(dtype)
    offs = group_sizes_to_offsets(res.group_sizes)
    out = grouped_mm(res.tokens, w, offs=offs)
    want, used = _loop_mm(res.tokens, w, res.group_sizes)
    assert out.shape == (res.tokens.shape[0], N)
    assert int(offs[-1]) == used
    # the per-group results agree (same fp32 accumulation up to summation order)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out[:used].float(), want.float(), **tol)
    # expert 3 (no tokens) is an empty group: consecutive offsets are equal
    assert int(res.group_sizes[3]) == (5 if "capacity" in mode else 0)


def test_offsets_under_torch_compile():
    f = torch.compile(group_sizes_to_offsets, fullgraph=True, backend="aot_eager")
    gs = torch.tensor([2, 0, 7], dtype=torch.int64)
    assert torch.equal(f(gs), torch.tensor([2, 2, 9], dtype=torch.int32))


def test_offsets_refuse_int32_overflow():
    """The int32 offsets used to wrap silently ([2**31 - 1, 5] -> [2147483647, -2147483644]); now
    an error naming group_sizes, eager (ValueError) and compiled (a device-side assert)."""
    with pytest.raises(ValueError, match=r"^group_sizes sums to 2147483652, more than the int32"):
        group_sizes_to_offsets(torch.tensor([2 ** 31 - 1, 5]))
    with pytest.raises(ValueError, match=r"^group_sizes has value 4294967296 at index 1"):
        group_sizes_to_offsets(torch.tensor([0, 2 ** 32, -2 ** 32]))   # would not wrap the int32 sum
    with pytest.raises(ValueError, match=r"^group_sizes has value -1 at index 0"):
        group_sizes_to_offsets(torch.tensor([-1, 1], dtype=torch.int32))
    assert group_sizes_to_offsets(torch.tensor([2 ** 31 - 2, 1])).tolist() == [2 ** 31 - 2, 2 ** 31 - 1]
    f = torch.compile(group_sizes_to_offsets, fullgraph=True, backend="aot_eager")
    assert f(torch.tensor([2, 0, 7])).tolist() == [2, 2, 9]
    with pytest.raises(RuntimeError, match=r"^group_sizes: a size outside \[0, 2\*\*31 - 1\] or a sum"):
        f(torch.tensor([2 ** 31 - 1, 5]))


def _decode_group_list(group_list, group_list_type):
    """How torch_npu's npu_grouped_matmul reads ``group_list`` (documented semantics):
    type 0 = cumulative end offsets, type 1 = per-group counts."""
    if group_list_type == 0:
        return torch.diff(group_list, prepend=group_list.new_zeros(1))
    return group_list


@pytest.mark.parametrize("group_list_type", [0, 1])
@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_group_list_forms(group_list_type, mode):
    res = _permuted(torch.float32, mode)
    gl = group_sizes_to_group_list(res.group_sizes, group_list_type)
    assert gl.dtype == torch.int64 and gl.shape == res.group_sizes.shape
    if group_list_type == 0:
        assert torch.equal(gl, torch.cumsum(res.group_sizes, 0))
        assert torch.equal(gl, group_sizes_to_offsets(res.group_sizes).long())
    else:
        assert torch.equal(gl, res.group_sizes)
    assert torch.equal(_decode_group_list(gl, group_list_type), res.group_sizes)


def test_group_list_from_int32_sizes():
    gs = torch.tensor([1, 0, 4], dtype=torch.int32)
    assert group_sizes_to_group_list(gs, 0).tolist() == [1, 1, 5]
    assert group_sizes_to_group_list(gs, 1).dtype == torch.int64


def test_bad_inputs():
    with pytest.raises(ValueError, match="group_list_type must be 0 .cumsum. or 1 .counts., got 2"):
        group_sizes_to_group_list(torch.tensor([1, 2]), 2)
    with pytest.raises(ValueError, match="group_sizes must be 1-D"):
        group_sizes_to_offsets(torch.ones(2, 2, dtype=torch.int64))
    with pytest.raises(TypeError, match="group_sizes must have dtype"):
        group_sizes_to_offsets(torch.ones(3))
    with pytest.raises(TypeError, match="group_sizes must be a torch.Tensor"):
        group_sizes_to_group_list([1, 2], 1)


def test_group_list_refuses_negative_sizes_and_a_bool_type():
    with pytest.raises(ValueError, match=re.escape("group_sizes has value -2 at index (1,): sizes must be >= 0")):
        group_sizes_to_group_list(torch.tensor([3, -2, 4]), 0)
    with pytest.raises(TypeError, match="group_list_type must be an int, got bool"):
        group_sizes_to_group_list(torch.tensor([3, 2]), True)


def test_group_list_cumsum_refuses_a_wrap_past_int64_and_compiles():
    """The cumulative group_list of sizes summing past 2**63 - 1 wrapped silently ([4.6e18, -9.2e18,
    ...]); it is now an error naming group_sizes. Under torch.compile(fullgraph=True) the check is
    an assert in the graph (the fake-tensor test could not be traced)."""
    with pytest.raises(ValueError, match="group_sizes .*wraps past int64"):
        group_sizes_to_group_list(torch.tensor([2 ** 62] * 3), 0)
    f = torch.compile(lambda s: group_sizes_to_group_list(s, 0), fullgraph=True, backend="eager")
    assert f(torch.tensor([1, 2, 3])).tolist() == [1, 3, 6]
