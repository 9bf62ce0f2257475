"""Triton kernels (CUDA; on CPU tensors under ``TRITON_INTERPRET=1``). One module per op."""
