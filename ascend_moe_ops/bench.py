"""Benchmark + parity report: the package's main job.

    python -m ascend_moe_ops.bench --list                 # the ops that have benchmarks
    python -m ascend_moe_ops.bench                        # quick preset (about a minute on 2 cores)
    python -m ascend_moe_ops.bench --preset pangu --ops moe_permute grouped_gemm

Everything lives in :mod:`ascend_moe_ops.benchmark` (the timer, limits, report, chart, CLI); the
bench modules import ``Row`` and ``parity_row`` from here.
"""

import sys

from .benchmark.cli import main
from .benchmark.rows import ParityRow, Row, parity_row
from .benchmark.runner import Context

__all__ = ["Context", "ParityRow", "Row", "main", "parity_row"]

if __name__ == "__main__":
    sys.exit(main())
