"""cuTile (cuda.tile) kernels: forward and backward per kernel family (GPU only).

Their compilations are kept on disk for the next process (:mod:`._cache`)."""
from . import _cache

try:
    _cache.install()
except ImportError:  # no cuda-tile here: the kernel modules say so when imported
    pass
