"""Triton implementations of the ``ascend_moe_ops`` ops (the ``triton`` backend).

The kernels run on CUDA tensors, and on CPU tensors under Triton's interpreter when the
environment variable ``TRITON_INTERPRET=1`` is set *before* ``triton`` is first imported (the test
suite does this in ``tests/conftest.py``). The interpreter is for correctness only: it is slow and
says nothing about speed.

Every public function here has exactly the positional signature of its op's schema in
``ascend_moe_ops/ops/<op>.py`` (its ``OpSpec``); the op wrappers in ``ascend_moe_ops/ops`` do the argument checks and
autograd, and the backend router calls these functions (``ascend_moe_ops/_backends.py``).
"""
