"""mhctool: numerics validation for fused mHC and grouped-MLP kernels."""
__version__ = "0.1.0"
