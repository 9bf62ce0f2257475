"""MoE layers built on the ops."""
