"""Human-friendly sizes for the CLI: ``8k`` = 8,192 and ``1.5m`` = 1,572,864 (binary multiples).

Binary multiples because KV sizes are quoted that way in the benchmark (``8k`` KV = 8,192 tokens).
"""

from __future__ import annotations

_MULTIPLIERS = {"k": 1024, "m": 1024 * 1024, "g": 1024 * 1024 * 1024}


def parse_count(text: str) -> int:
    """Parse ``"8192"``, ``"8k"``, ``"1.5m"`` into a non-negative int; raise ValueError otherwise."""
    raw = str(text).strip().lower().replace("_", "").replace(",", "")
    if not raw:
        raise ValueError("empty size")
    multiplier = 1
    if raw[-1] in _MULTIPLIERS:
        multiplier = _MULTIPLIERS[raw[-1]]
        raw = raw[:-1]
    try:
        value = float(raw) if "." in raw else int(raw)
    except ValueError:
        raise ValueError(f"not a size: {text!r} (use e.g. 8192, 8k, 1.5m)") from None
    result = value * multiplier
    if result < 0:
        raise ValueError(f"size must be non-negative, got {text!r}")
    if result != int(result):
        raise ValueError(f"size {text!r} is not a whole number")
    return int(result)
