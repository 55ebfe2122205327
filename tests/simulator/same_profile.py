"""Comparing a freshly fitted calibration profile with the committed file."""

import pytest


def assert_same_profile(fresh, committed, path="profile"):
    """The same profile as the committed file: every key and non-float value equal, floats to 1e-9 relative (a
    least-squares fit's last digits follow the BLAS and numpy build the CI installs, not the records)."""
    if isinstance(committed, float) or isinstance(fresh, float):
        assert fresh == pytest.approx(committed, rel=1e-9, abs=1e-15), path
    elif isinstance(committed, dict):
        assert isinstance(fresh, dict) and fresh.keys() == committed.keys(), path
        for key in committed:
            assert_same_profile(fresh[key], committed[key], f"{path}.{key}")
    elif isinstance(committed, list):
        assert isinstance(fresh, list) and len(fresh) == len(committed), path
        for i, (a, b) in enumerate(zip(fresh, committed, strict=True)):
            assert_same_profile(a, b, f"{path}[{i}]")
    else:
        assert fresh == committed, path
