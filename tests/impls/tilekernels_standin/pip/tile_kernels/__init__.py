"""Stand-in for pip tile-kernels 2.1.0 (see ../../README.md)."""
__version__ = "standin"
