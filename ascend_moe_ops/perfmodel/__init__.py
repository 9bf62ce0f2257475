"""Performance models: what the package predicts where it cannot measure.

Two levels, data flowing one way (docs/design.md, "Performance models"):

- kernel level: an Atlas A2 timeline of each AscendC kernel launch, built from the emulator's pipe
  model and one hardware table;
- step level: a bottom-up training-step simulator that consumes per-op costs.

Every number here is a **model**: wherever it is shown it is labelled as such, with the version of
the hardware table it came from. Hardware tables are data (``hardware/<name>.json``), each entry
citing a public source or marked as an assumption; :mod:`.hardware` loads and checks them.
"""

from .hardware import HardwareTable, available_tables, load_table

__all__ = ["HardwareTable", "available_tables", "load_table"]
