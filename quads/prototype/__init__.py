"""Prototypes: code that only tests and benchmarks reach, kept as the base of a next step (torchao keeps
such code under ``prototype/``). Nothing in the product path imports this package."""
