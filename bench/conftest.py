"""pytest-benchmark suite of the bench modules: ``python -m pytest bench/`` collects the cases
``python -m ascend_moe_ops.bench`` times (quick preset by default; ``--amo-preset pangu`` for the
big shapes, ``--amo-ops moe_permute grouped_gemm`` for some modules), so ``--benchmark-autosave``
and ``--benchmark-compare`` work on exactly the table's rows."""


def pytest_addoption(parser):
    g = parser.getgroup("ascend_moe_ops bench")
    g.addoption("--amo-preset", default="quick", help="shape preset (quick, pangu, deepseek-v3)")
    g.addoption("--amo-ops", nargs="*", default=None, help="bench modules / ops to collect")


def pytest_generate_tests(metafunc):
    if "amo_case" not in metafunc.fixturenames:
        return
    from ascend_moe_ops.benchmark import collect_cases
    cfg = metafunc.config
    cases = collect_cases(preset=cfg.getoption("--amo-preset"), ops=cfg.getoption("--amo-ops"))
    metafunc.parametrize("amo_case", cases, ids=[c.id for c in cases])
