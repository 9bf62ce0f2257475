"""Bottom-up training-step simulator (docs/perfmodel/training_sim.md).

``simulate(model, cluster, plan)`` -> :class:`StepResult` (timeline, step time, memory per device,
traffic per link class, MFU per FLOPs convention with its formula); ``search(...)`` ranks plans.
Per-op costs come from a pluggable :class:`~.costs.CostProvider` (roofline from a hardware table,
or fitted to this machine's microbenchmarks). Every number it returns is a model.
"""

from .costs import CostProvider, FittedCosts, LayerGlue, LinkModel, Op, RooflineCosts
from .model import CONVENTIONS, PANGU_ULTRA_MOE, ModelSpec, flops_per_token, params
from .step import Cluster, Plan, StepResult, pipeline_schedule, search, simulate

__all__ = ["CostProvider", "FittedCosts", "LayerGlue", "LinkModel", "Op", "RooflineCosts", "CONVENTIONS",
           "PANGU_ULTRA_MOE", "ModelSpec", "flops_per_token", "params", "Cluster", "Plan", "StepResult",
           "pipeline_schedule", "search", "simulate"]
