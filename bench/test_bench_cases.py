"""The benchmark table's cases under pytest-benchmark (collected in conftest.py)."""

from ascend_moe_ops.benchmark.suite.bench_ep_dispatcher import (  # noqa: F401  (its CLI case needs 4 processes)
    test_bench_ep_dispatcher_single_rank,
)


def test_case(benchmark, amo_case):
    benchmark(amo_case.fn)
