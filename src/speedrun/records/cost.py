"""What a run cost: seconds x the device's price per hour, for the timed region and for the whole command.

The price comes from `--price-per-hour` (US dollars per device-hour: one GPU, or one CPU machine), else from the
table below, matched by a substring of the device's name; a device with no entry has no cost (None), never a
guess. The table is a default to edit: a JSON file named by SPEEDRUN_PRICES ({"H100": 2.49, ...}, dollars per
device-hour) replaces it. Prices move; each entry says where and when it was read.
"""

from __future__ import annotations

import json
import math
import os
import stat
from dataclasses import dataclass

from speedrun.errors import printable
from speedrun.paths import user_path

# (substring of torch.cuda.get_device_name(), USD per GPU-hour on demand, source). First match wins, so the more
# specific names come first.
DEFAULT_PRICES: list[tuple[str, float, str]] = [
    ("H100", 2.49, "Lambda on-demand, 1x H100, as quoted by computespec.pages.dev, 'Cloud GPU pricing explained', "
                   "read 2026-11"),
    ("A100", 1.99, "midpoint of the $1.49-2.49 on-demand range for A100 80GB SXM in early 2026, "
                   "pricegpu.pages.dev, 'H100 vs A100 cloud pricing', read 2026-11"),
]
MAX_PRICE_PER_HOUR = 10_000.0  # dollars per device-hour: more is a typo
MAX_TABLE_BYTES = 1_000_000  # a SPEEDRUN_PRICES file: thousands of entries fit


@dataclass(frozen=True)
class Price:
    per_hour: float  # US dollars per device-hour
    source: str

    def to_dict(self) -> dict:
        return {"price_per_hour": self.per_hour, "price_source": self.source}


def _check(value: object, where: str) -> float:
    ok = not isinstance(value, bool) and isinstance(value, (int, float))
    try:
        ok = ok and math.isfinite(value) and 0 <= value <= MAX_PRICE_PER_HOUR
    except OverflowError:  # an int of hundreds of digits
        ok = False
    if not ok:
        raise ValueError(f"{where}: a price is dollars per device-hour in [0, {MAX_PRICE_PER_HOUR:g}], got {value!r}")
    return float(value)


def _table() -> list[tuple[str, float, str]]:
    path = os.environ.get("SPEEDRUN_PRICES")
    if not path:
        return DEFAULT_PRICES
    try:
        file = user_path(path, "SPEEDRUN_PRICES")
        info = file.stat()
        if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_TABLE_BYTES:  # a fifo, /dev/zero, a huge file
            raise ValueError(f"not a regular file of at most {MAX_TABLE_BYTES} bytes")
        table = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:
        raise ValueError(f"SPEEDRUN_PRICES={path}: cannot read a JSON price table ({e}); give a file such as "
                         '{"H100": 2.49}, or unset it') from None
    if not isinstance(table, dict) or not all(isinstance(k, str) and k for k in table):
        raise ValueError(f"SPEEDRUN_PRICES={path}: expected a JSON object of device name -> dollars per hour")
    # the source is stored in every result (and shown from there): the path as errors.printable shows it, as a stored
    # dataset name is; messages carry it as it is and are escaped where they are shown (cli/output.py)
    source = f"SPEEDRUN_PRICES ({printable(path)})"
    return [(name, _check(v, f"SPEEDRUN_PRICES {name}"), source) for name, v in table.items()]


def price_for(device_name: str | None, per_hour: float | None = None) -> Price | None:
    """The price of one device-hour: `per_hour` (--price-per-hour) if given, else the table's entry for the
    device's name, else None."""
    if per_hour is not None:
        return Price(_check(per_hour, "--price-per-hour"), "--price-per-hour")
    for name, price, source in _table():
        if device_name and name.lower() in device_name.lower():
            return Price(price, source)
    return None


def dollars(seconds: float | None, price: Price | None, devices: int = 1) -> float | None:
    """seconds on `devices` devices at `price`, in US dollars (None without a price or seconds)."""
    if price is None or seconds is None:
        return None
    return seconds * devices * price.per_hour / 3600
