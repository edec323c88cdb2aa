"""Triton kernels and their launchers, one module per op (no torch.library code here)."""
