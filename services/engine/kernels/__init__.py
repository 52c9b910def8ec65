"""Fused GPU kernels of the engine, each next to the PyTorch reference it must match."""
