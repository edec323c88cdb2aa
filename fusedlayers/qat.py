"""Quantization-aware training: prepare/convert (see issue 5; not implemented yet)."""
