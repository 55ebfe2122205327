"""Triton kernels, one per file."""
