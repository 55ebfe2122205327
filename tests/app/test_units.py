import pytest

from app.units import parse_count


@pytest.mark.parametrize(
    ("text", "value"),
    [("8192", 8192), ("8k", 8192), ("8K", 8192), ("1.5m", 1572864), ("453_005", 453005), ("0", 0), ("2g", 2**31), ("1e4", 10000),
     ("1.0e3k", 1024000)],
)
def test_sizes(text, value):
    assert parse_count(text) == value


@pytest.mark.parametrize("text", ["", "k", "-5", "1.3", "eight", "8kk", "1.5", "1.0e999", "1e999999999999", "inf",
                                  "-inf", "nan", "snan", "1e16k", "9" * 5000, "-0.5", "1e-999"])
def test_bad_sizes_are_refused(text):
    with pytest.raises(ValueError):
        parse_count(text)
