from .ops import mhc_pre_apply_mix, mhc_pre_norm_fn, mhc_pre_split_mixes, sinkhorn_normalize  # noqa: F401
