"""Human-friendly sizes for the CLI: ``8k`` = 8,192 and ``1.5m`` = 1,572,864 (binary multiples).

Binary multiples because KV sizes are quoted that way in the benchmark (``8k`` KV = 8,192 tokens).
"""

from __future__ import annotations

from decimal import Decimal, InvalidOperation

_MULTIPLIERS = {"k": 1024, "m": 1024 * 1024, "g": 1024 * 1024 * 1024}
# NOTE: far above any pool (2**50 KV tokens is petabytes); bounds int() of "1e999999999".
MAX_COUNT = 2**50


def parse_count(text: str) -> int:
    """Parse ``"8192"``, ``"8k"``, ``"1.5m"``, ``"1e4"`` into an int in [0, MAX_COUNT]; raise
    ValueError otherwise (never OverflowError: ``"1.0e999"`` and ``"inf"`` are plain bad values)."""
    raw = str(text).strip().lower().replace("_", "").replace(",", "")
    if not raw:
        raise ValueError("empty size")
    multiplier = 1
    if raw[-1] in _MULTIPLIERS:
        multiplier = _MULTIPLIERS[raw[-1]]
        raw = raw[:-1]
    try:
        value = Decimal(raw)  # exact: no float rounding, no overflow
    except InvalidOperation:
        raise ValueError(f"not a size: {text!r} (use e.g. 8192, 8k, 1.5m)") from None
    if not value.is_finite():
        raise ValueError(f"not a size: {text!r} (use e.g. 8192, 8k, 1.5m)")
    if value < 0:
        raise ValueError(f"size must be non-negative, got {text!r}")
    if value > MAX_COUNT:  # NOTE: before multiplying: Decimal arithmetic can overflow its context
        raise ValueError(f"size {text!r} is too large (at most {MAX_COUNT})")
    result = value * multiplier
    if result > MAX_COUNT:
        raise ValueError(f"size {text!r} is too large (at most {MAX_COUNT})")
    if result != result.to_integral_value():
        raise ValueError(f"size {text!r} is not a whole number")
    return int(result)
