"""Stand-in for TileKernels' GitHub layout (see ../../README.md)."""
__version__ = "standin"
