"""Graph-captured CUDA executor: device-side expert residency, Triton kernels, CUDA graphs."""
