"""A CUDA graph of a test's step, captured the way the executors capture theirs."""

from collections.abc import Callable

import torch


def capture(step: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """step run once on a side stream (compiles and warms up its kernels outside the capture), then captured."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph
