"""cuTile (cuda.tile) kernels: forward and backward per kernel family (GPU only).

Their compilations are kept on disk for the next process (:mod:`._cache`)."""
from . import _cache

_cache.install()
