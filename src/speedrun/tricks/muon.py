"""Muon: momentum SGD whose update for each conv filter bank is orthogonalized (Jordan et al. 2024; it holds the
airbench94 record: 3.09 s -> 2.59 s on an A100, airbench94_muon).

What: the Nesterov momentum of a weight W (c_out, c_in, k, k), viewed as a (c_out, c_in*k*k) matrix G, is
replaced by the nearest semi-orthogonal matrix, approximately U V^T of G = U S V^T, computed with a few
Newton-Schulz iterations x <- a x + (b A + c A^2) x, A = x x^T, with the quintic coefficients
(3.4445, -4.7750, 2.0315) that push all singular values into ~[0.7, 1.2] in 3-5 iterations. Before each step
the filter bank is renormalized to norm sqrt(c_out), so the lr sets an angular step size.
Why: the orthogonalized update moves every direction of the filter bank at a similar rate, instead of being
dominated by a few large singular directions, so fewer steps reach the same loss.
Suggested (airbench94_muon): lr 0.24, momentum 0.6, Nesterov, 3 iterations in bf16, batch 2000, 8 epochs;
other parameters (biases, head) on Nesterov SGD. Without Nesterov: 93.73% instead of 94.01% (n >= 300).
Interactions: no Lookahead in that recipe; the lr schedule multiplies `lr` like any param group's.
"""

from __future__ import annotations

import torch

NS_COEFFS = (3.4445, -4.7750, 2.0315)


def newton_schulz(g: torch.Tensor, steps: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Approximate orthogonalization of a 2-D matrix g (m, n) -> (m, n) with singular values near 1."""
    a, b, c = NS_COEFFS
    x = g.to(dtype)
    transposed = x.shape[0] > x.shape[1]
    if transposed:  # iterate on the wide form: A = x x^T is then the smaller Gram matrix
        x = x.T
    x = x / (x.norm() + 1e-7)  # spectral norm <= Frobenius norm <= 1: inside the iteration's basin
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x.T if transposed else x).to(g.dtype)


class Muon(torch.optim.Optimizer):
    def __init__(self, params, lr: float, momentum: float, nesterov: bool = True, ns_steps: int = 3):
        super().__init__(params, dict(lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps))

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is None
        for group in self.param_groups:
            mu = group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = state["momentum_buffer"]
                buf.mul_(mu).add_(p.grad)
                g = p.grad.add(buf, alpha=mu) if group["nesterov"] else buf
                p.mul_(len(p) ** 0.5 / p.norm())
                # bf16 on accelerators (as in airbench94_muon); fp32 on CPU, where bf16 matmul is slow.
                dtype = torch.float32 if p.device.type == "cpu" else torch.bfloat16
                update = newton_schulz(g.reshape(len(g), -1), group["ns_steps"], dtype).view_as(g)
                p.add_(update, alpha=-group["lr"])
