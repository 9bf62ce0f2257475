"""Triton kernels (CUDA; CPU under ``TRITON_INTERPRET=1``): one module per op."""
