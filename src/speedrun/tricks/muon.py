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

Two speed changes of Hiverge's 2025 record (hiverge/cifar10-speedrun, README "Vectorised optimiser": 2.59 s ->
2.015 s on an A100 together with the other changes listed there), each a switch whose off setting is the rule above:
  batched=True: one Newton-Schulz chain for every filter bank of the group at once (newton_schulz_batched): the
    matrices are zero-padded into one (P, m, n) tensor, so 3 iterations are 9 batched matmuls instead of 9 per
    filter bank. Zero padding leaves the polynomial's result on the original block unchanged (block-diagonal
    algebra), so only rounding differs from the per-bank loop.
  compiled=True: both Newton-Schulz functions compiled by torch.compile (static shapes), which fuses the iteration's
    scalings and additions around its matmuls; off calls them as written.
  renorm_every_steps=K: the filter banks are renormalized to sqrt(c_out) before every K-th step only (K = 1 is
    every step); in between their norm drifts up slowly, as each orthogonal update adds about lr^2 * c_out to the
    squared norm. Hiverge's interval adapts to training; here it is fixed.
"""

from __future__ import annotations

import torch

from speedrun.tricks.precision import compile_static

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


def newton_schulz_batched(gs: list[torch.Tensor], steps: int,
                          dtype: torch.dtype = torch.bfloat16) -> list[torch.Tensor]:
    """newton_schulz of every 2-D matrix in gs at once: each (m_i, n_i) is put in its wide orientation, zero-padded
    into one (P, max m, max n) tensor, iterated as a batch, and cut back out (m_i, n_i)."""
    a, b, c = NS_COEFFS
    tall = [g.shape[0] > g.shape[1] for g in gs]
    wide = [g.T if t else g for g, t in zip(gs, tall)]
    rows, cols = max(w.shape[0] for w in wide), max(w.shape[1] for w in wide)
    x = torch.zeros(len(gs), rows, cols, dtype=dtype, device=gs[0].device)  # (P, m, n)
    for i, w in enumerate(wide):
        x[i, :w.shape[0], :w.shape[1]] = w
    x = x / (x.norm(dim=(1, 2), keepdim=True) + 1e-7)  # each matrix by its own norm, as newton_schulz
    for _ in range(steps):
        gram = x @ x.mT  # (P, m, m)
        x = a * x + (b * gram + c * gram @ gram) @ x
    out = []
    for i, (g, w, t) in enumerate(zip(gs, wide, tall)):
        block = x[i, :w.shape[0], :w.shape[1]]
        out.append((block.T if t else block).to(g.dtype))
    return out


class Muon(torch.optim.Optimizer):
    """batched and renorm_every_steps are how the step is computed, not hyperparameters of a group: they stay out
    of param_groups, so checkpoints of either setting load into the other."""

    def __init__(self, params, lr: float, momentum: float, nesterov: bool = True, ns_steps: int = 3,
                 batched: bool = False, renorm_every_steps: int = 1, compiled: bool = False):
        super().__init__(params, dict(lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps))
        self.batched = batched
        self.renorm_every_steps = renorm_every_steps
        self.orthogonalize, self.orthogonalize_batched = newton_schulz, newton_schulz_batched
        if compiled:
            self.orthogonalize = compile_static(newton_schulz)
            self.orthogonalize_batched = compile_static(newton_schulz_batched)

    def _renormalize(self, p: torch.Tensor) -> None:
        """Rescale p to norm sqrt(c_out) before every renorm_every_steps-th step, counting from the first."""
        if self.renorm_every_steps == 1:  # no counter in the state: a per-step run's checkpoint stays as it was
            p.mul_(len(p) ** 0.5 / p.norm())
            return
        state = self.state[p]
        count = state.get("renorm_count", 0)
        if count % self.renorm_every_steps == 0:
            p.mul_(len(p) ** 0.5 / p.norm())
        state["renorm_count"] = count + 1

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is None
        for group in self.param_groups:
            mu = group["momentum"]
            params, directions = [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = state["momentum_buffer"]
                buf.mul_(mu).add_(p.grad)
                g = p.grad.add(buf, alpha=mu) if group["nesterov"] else buf
                self._renormalize(p)
                if self.batched:
                    params.append(p)
                    directions.append(g.reshape(len(g), -1))
                    continue
                update = self.orthogonalize(g.reshape(len(g), -1), group["ns_steps"], _ns_dtype(p)).view_as(g)
                p.add_(update, alpha=-group["lr"])
            if params:
                updates = self.orthogonalize_batched(directions, group["ns_steps"], _ns_dtype(params[0]))
                for p, update in zip(params, updates):
                    p.add_(update.view_as(p), alpha=-group["lr"])


def _ns_dtype(p: torch.Tensor) -> torch.dtype:
    # bf16 on accelerators (as in airbench94_muon); fp32 on CPU, where bf16 matmul is slow.
    return torch.float32 if p.device.type == "cpu" else torch.bfloat16
