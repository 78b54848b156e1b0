"""Triton kernels: forward and backward per kernel family (CPU tests run them through TRITON_INTERPRET=1)."""
