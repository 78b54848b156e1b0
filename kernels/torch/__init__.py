"""Native PyTorch implementations: the baseline a fused kernel is judged against."""
