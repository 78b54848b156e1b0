"""cuTile (cuda.tile) kernels: forward and backward per kernel family (GPU only)."""
