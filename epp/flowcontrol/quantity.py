"""Kubernetes resource quantities ("1Gi", "500M", "10k", "1e3", 4096) as whole numbers.

The reference reads `maxBytes` and `maxRequests` as `resource.Quantity`, so configs written for
it use these suffixes. Fractions round up, as `Quantity.Value()` does.
"""

from __future__ import annotations

import re
from decimal import ROUND_CEILING, Decimal, InvalidOperation
from typing import Any

_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {"n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "": Decimal(1),
            "k": Decimal(10**3), "M": Decimal(10**6), "G": Decimal(10**9), "T": Decimal(10**12),
            "P": Decimal(10**15), "E": Decimal(10**18)}
_QUANTITY = re.compile(r"^\+?((?:\d+\.?\d*)|(?:\.\d+))(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][+-]?\d+)?$")


def parse_quantity(value: Any) -> int:
    """A non-negative whole number from an int or a quantity string; raises ValueError."""
    if isinstance(value, bool):
        raise ValueError(f"invalid quantity {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"invalid quantity {value!r}: negative")
        return value
    if isinstance(value, float):
        if value < 0 or value != value or value in (float("inf"),):
            raise ValueError(f"invalid quantity {value!r}")
        return int(Decimal(repr(value)).to_integral_value(ROUND_CEILING))
    if not isinstance(value, str):
        raise ValueError(f"invalid quantity {value!r}")
    m = _QUANTITY.match(value.strip())
    if m is None:
        raise ValueError(f"invalid quantity {value!r} (e.g. 1000, 500M, 1Gi)")
    try:
        number = Decimal(m.group(1))
    except InvalidOperation:
        raise ValueError(f"invalid quantity {value!r}") from None
    suffix = m.group(2) or ""
    if suffix in _BINARY:
        number *= _BINARY[suffix]
    elif suffix in _DECIMAL:
        number *= _DECIMAL[suffix]
    else:  # exponent, e.g. 1e3
        number *= Decimal(10) ** int(suffix[1:])
    return int(number.to_integral_value(ROUND_CEILING))
