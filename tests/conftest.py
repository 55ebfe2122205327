"""Suite-wide settings: Hypothesis profiles and the GPU marker."""

import os

import pytest
from hypothesis import HealthCheck, settings

# Triton kernels run in Triton's interpreter where there is no CUDA device (tiny shapes, CPU CI). Set
# before any kernel module is imported: triton.jit reads it at decoration time. A GPU host leaves it unset.
try:
    import torch as _torch

    if not _torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:
    pass

# NOTE: "ci" is the default; state machines set their own max_examples (hundreds) explicitly.
settings.register_profile("ci", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", parent=settings.get_profile("ci"), max_examples=20)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
