"""Load balancing for MoE training: auxiliary losses at every level, token-drop accounting, and
dynamic expert placement (load predictor, planner, executor). See docs/ops/balance.md."""

from .aux_loss import (LEVELS, DropStats, aux_loss, biased_topk, capacity_for, drop_stats,
                       expert_counts, update_expert_bias, z_loss)
from .predictor import ExpertLoadPredictor
from .executor import PlacementExecutor, canonical, check_consistent
from .planner import (MoveCost, Placement, coefficient_of_variation, default_max_moves, imbalance,
                      plan_placement)

__all__ = [
    "LEVELS", "DropStats", "aux_loss", "biased_topk", "capacity_for", "drop_stats", "expert_counts",
    "update_expert_bias", "z_loss", "ExpertLoadPredictor", "Placement", "coefficient_of_variation",
    "imbalance", "plan_placement", "MoveCost", "default_max_moves", "PlacementExecutor", "canonical", "check_consistent",
]
