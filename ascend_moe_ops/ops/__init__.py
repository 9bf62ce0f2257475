"""Public op wrappers: one module per op (docstring, checks, fake + autograd registration)."""
