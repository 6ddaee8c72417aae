"""``--link-rate``: a rate in tc's units, to bytes per second, and the tbf qdisc that shapes a
link to it.

As in tc, ``bit kbit mbit gbit tbit`` are bits per second and ``bps kbps mbps gbps tbps`` are
BYTES per second, the prefixes SI (k = 1000); a bare number is refused (tc would read bits).
"""

from __future__ import annotations

import re
from typing import List

FLAG = "--link-rate"
UNITS = {
    "bit": 1 / 8,
    "kbit": 1e3 / 8,
    "mbit": 1e6 / 8,
    "gbit": 1e9 / 8,
    "tbit": 1e12 / 8,
    "bps": 1.0,
    "kbps": 1e3,
    "mbps": 1e6,
    "gbps": 1e9,
    "tbps": 1e12,
}
FORMS = (
    "a number and a tc unit: bit, kbit, mbit, gbit (bits/s) or bps, kbps, mbps, gbps (bytes/s), "
    "e.g. 200mbit"
)
RATE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]+)\s*$")
# tbf: a bucket of at least 256 KiB (above lo's 64 KiB MTU) or 10 ms of the rate, and packets
# queued at most 50 ms.
MIN_BURST_BYTES = 256 * 1024
BURST_S = 0.01
LATENCY = "50ms"


def parse_link_rate(text: str) -> float:
    """``text`` in bytes per second; a ValueError naming the flag, the value and the accepted
    forms when it is not a positive rate in tc's units."""
    match = RATE.match(text)
    unit = match.group(2).lower() if match else ""
    if not match or unit not in UNITS:
        raise ValueError(f"{FLAG}={text!r} is not a rate: give {FORMS}.")
    rate = float(match.group(1)) * UNITS[unit]
    if rate < 1:
        raise ValueError(f"{FLAG}={text!r}: the rate must be at least 1 byte/s; give {FORMS}.")
    return rate


def tbf_args(bytes_per_s: float) -> List[str]:
    """``tc qdisc add dev DEV root`` + these: a tbf shaping the device's egress to the rate."""
    burst = max(MIN_BURST_BYTES, int(bytes_per_s * BURST_S))
    rate_bits = max(8, round(bytes_per_s * 8))
    return ["tbf", "rate", f"{rate_bits}bit", "burst", str(burst), "latency", LATENCY]


def megabytes(bytes_per_s: float) -> str:
    """``25.0 MB/s`` (SI megabytes, as tc's mbps)."""
    return f"{bytes_per_s / 1e6:.1f} MB/s"
