"""Triton kernels of the fast path (issue 8): one kernel + launcher + shape checks per module.

The torch path (adapters/torch_exec/) stays the numerical reference; every kernel here is tested
against it on the CPU under TRITON_INTERPRET=1 and on the GPU at real shapes.
NOTE: nothing is imported here: importing one kernel module does not build the others.
"""
