"""pytest plugin of tests/sanitize.sh: keeps only the tests that build and run a C++ test driver
(a fixture whose name ends in ``driver``, or a test calling ``compile_cached`` itself), which
``ASCEND_MOE_OPS_CXX_SANITIZE=1`` then builds with AddressSanitizer/UBSan."""

import inspect


def _runs_a_driver(item) -> bool:
    if any(name.endswith("driver") for name in getattr(item, "fixturenames", ())):
        return True
    fn = getattr(item, "function", None)
    try:
        return fn is not None and "compile_cached" in inspect.getsource(fn)
    except (OSError, TypeError):
        return False


def pytest_collection_modifyitems(config, items):
    keep = [it for it in items if _runs_a_driver(it)]
    dropped = [it for it in items if not _runs_a_driver(it)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = keep
