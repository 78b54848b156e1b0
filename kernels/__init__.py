"""Implementations under test, one module per kernel family and backend (installed as mhctool.kernels)."""
