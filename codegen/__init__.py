"""Code generation: spec + plan -> Triton kernels and torch modules under generated/."""

__version__ = "0.1.0"
