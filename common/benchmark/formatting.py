"""How 05's reports print numbers: "-" for a missing value, two decimals unless told."""
from __future__ import annotations


def fmt(x, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def fmt_ci(ci) -> str:
    """A 95% interval as "[lo, hi]", "-" when there is none."""
    return "-" if not ci or ci[0] is None else f"[{ci[0]:.2f}, {ci[1]:.2f}]"
