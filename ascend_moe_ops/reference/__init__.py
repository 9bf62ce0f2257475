"""Pure-PyTorch references: the specification of every op and the oracle of every test."""
