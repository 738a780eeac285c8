"""Minimal reproduction: the backward of torch.amax over several dims, compiled by inductor, gives non-finite
gradients in bf16 where eager mode gives finite ones.

    python benchmarks/repro_amax_compile.py            # CPU (bf16)
    python benchmarks/repro_amax_compile.py --device cuda

Seen with torch 2.13.0+cpu on an Intel Xeon and torch 2.11.0+cu130 on an H100 (fp16 autocast there): the cifar
network's global max pool was torch.amax(x, dim=(2, 3)), and every compiled run's loss was NaN from its second step.
amax's gradient is shared among tied maxima, and bf16 rounding makes ties common; max pooling, which sends the
gradient to one maximum, compiles correctly. Prints one line per mode; exit status 1 when the compiled gradient
is not finite (the bug is present), 0 otherwise.
"""

from __future__ import annotations

import argparse
import sys

import torch


def loss(t: torch.Tensor) -> torch.Tensor:
    # (64, 32, 3, 3): the shape of the network's last feature map on a small batch; GELU in bf16 makes ties.
    return torch.amax(torch.nn.functional.gelu(t.bfloat16()), dim=(2, 3)).float().sum()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    finite = {}
    for name, fn in (("eager", loss), ("compiled", torch.compile(loss))):
        torch.manual_seed(0)
        x = torch.randn(64, 32, 3, 3, device=args.device, requires_grad=True)
        fn(x).backward()
        finite[name] = bool(torch.isfinite(x.grad).all())
        print(f"{name}: gradient finite: {finite[name]} (torch {torch.__version__}, {args.device})")
    return 0 if finite["compiled"] else 1


if __name__ == "__main__":
    sys.exit(main())
