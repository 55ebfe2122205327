"""Torch execution of MoE language models through a device expert-slot cache (CPU or CUDA)."""
