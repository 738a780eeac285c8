"""The triangular learning-rate schedule (Smith's one-cycle, linear form; Page part 1; airbench94).

What: the lr multiplier rises linearly from `start` to 1 at `peak_frac` of the steps, then falls linearly to
`end` at the last step. airbench94: start 0.2, peak 0.23, end 0.07. airbench94_muon: constant then linear
decay to 0 (start 1, peak 0, end 0).
Why: a short warm-up keeps the first steps of a high-lr, BN-free-scale net stable; the long linear decay to a
small lr does the annealing a short run needs.
"""

from __future__ import annotations


def triangle(step: int, total_steps: int, start: float, peak_frac: float, end: float) -> float:
    """lr multiplier at `step` in [0, total_steps]."""
    peak = int(peak_frac * total_steps)
    if step < peak:
        return start + (1 - start) * step / peak
    return 1 + (end - 1) * (step - peak) / max(1, total_steps - peak)
