"""The bench modules (installed as ``ascend_moe_ops.benchmark.suite``) and, with conftest.py
and test_bench_cases.py, the pytest-benchmark suite of the same cases."""
