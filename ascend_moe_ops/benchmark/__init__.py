"""The benchmark harness of ascend_moe_ops: one timer (:func:`measure`, torch.utils.benchmark
underneath), the machine limits measured in the same run, rows, report, chart and CLI.

The bench modules themselves (``bench/bench_<op>.py`` in a checkout) are installed as
``ascend_moe_ops.benchmark.suite``; ``python -m ascend_moe_ops.bench`` runs them and
``python -m pytest bench/`` collects the same cases for pytest-benchmark.
"""

from .rows import LIMIT_KINDS, ParityRow, Row, parity_row
from .runner import PRESETS, Context, collect_cases
from .timing import Timing, measure, noise_flags

__all__ = ["LIMIT_KINDS", "ParityRow", "Row", "parity_row", "PRESETS", "Context", "collect_cases",
           "Timing", "measure", "noise_flags"]
