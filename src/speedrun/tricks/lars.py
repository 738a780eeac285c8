"""LARS and LAMB: layer-wise trust ratios for large-batch training (You, Gitman, Ginsburg 2017, "Large Batch
Training of Convolutional Networks", arXiv 1708.03888; You et al. 2019, "Large Batch Optimization for Deep
Learning: Training BERT in 76 minutes", arXiv 1904.00962).

What: each parameter tensor ("layer") scales its step by a trust ratio, so that the step is a set fraction of
the tensor's own norm whatever the size of its gradient.
  LARS: d = local * (g + wd*w), local = trust_coefficient * ||w|| / (||g|| + wd*||w|| + eps); then momentum
        buf <- mu*buf + d and w <- w - lr*buf (Nesterov: w <- w - lr*(d + mu*buf)).
  LAMB: Adam moments with bias correction, r = m_hat / (sqrt(v_hat) + eps) + wd*w, w <- w - lr*(||w||/||r||)*r.
  Either ratio is 1 where ||w|| or the other norm is 0 (a zero-initialized tensor, a zero gradient), as in
  TensorFlow's LARSOptimizer.
Groups with "adapt": False (BatchNorm and bias: give them weight_decay 0 too) skip the ratio: a LARS group is
then torch.optim.SGD(momentum, nesterov) and a LAMB group torch.optim.AdamW (LAMB's r with ratio 1; with
weight_decay 0 that is plain Adam), bit for bit. TensorFlow's LARSOptimizer documents the same exclusion: "for a
typical classification model with batch normalization, the skip_list is ['batch_normalization', 'bias']".
lr sits outside the momentum buffer (PyTorch's SGD convention); the LARS paper's Algorithm 1 and TensorFlow put it
inside (v <- mu*v + lr*d). The two agree while lr is constant and differ only while a schedule moves it.
Why: at large batch and lr, ||g||/||w|| differs by orders of magnitude between layers, so one global lr diverges on
some layers while it crawls on others; the ratio makes every layer move by about lr * trust_coefficient * ||w||
per step. With LARS the paper trains AlexNet-BN to batch 8K and ResNet-50 to batch 32K without loss of accuracy.
Because the adapted step does not depend on ||g||, a loss scaled by any constant (with wd 0) gives the same step.
Suggested: LARS trust_coefficient 0.001, momentum 0.9, weight decay ~1e-4 (TensorFlow's defaults), with lr
warmup, linear lr scaling in the batch and polynomial decay (its docs); the global lr is then O(1-10), not 0.1.
LAMB: betas (0.9, 0.999), eps 1e-6, weight decay 0.01 (the BERT setting).
Interactions: the lr schedule multiplies group["lr"] (groups keep "initial_lr"); Lookahead/EMA compose; label
smoothing is independent. A tensor at zero (zero_init_residual's BN scales are excluded anyway) takes a full-lr
step with ratio 1.
"""

from __future__ import annotations

import torch


def _ratio(w_norm: torch.Tensor, other_norm: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """`value` where both norms are positive, else 1 (no scaling), elementwise over a (n_tensors,) stack."""
    return torch.where((w_norm > 0) & (other_norm > 0), value, 1.0)


def _norms(tensors: list[torch.Tensor]) -> torch.Tensor:
    """(n_tensors,) L2 norms in at least float32 (bf16 norms are too coarse for a ratio), one fused launch."""
    return torch.stack([n.to(torch.promote_types(n.dtype, torch.float32)) for n in torch._foreach_norm(tensors)])


def _closure_loss(closure):
    """torch.optim's step(closure) contract: the closure re-evaluates the loss with gradients on."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def _groups_with_grads(opt: torch.optim.Optimizer):
    """(group, its parameters that have a gradient, those gradients) for each group with any."""
    for group in opt.param_groups:
        params = [p for p in group["params"] if p.grad is not None]
        if params:
            yield group, params, [p.grad for p in params]


def _check(name: str, value: float, low: float, high: float = float("inf")) -> None:
    if not low <= value < high:
        raise ValueError(f"{name} must be in [{low}, {high}), got {value}")


class Lars(torch.optim.Optimizer):
    """SGD with momentum and a layer-wise trust ratio; groups with "adapt": False are plain torch.optim.SGD."""

    def __init__(self, params, lr: float, momentum: float = 0.9, weight_decay: float = 0.0,
                 trust_coefficient: float = 0.001, eps: float = 1e-8, nesterov: bool = False):
        for name, value, high in (("lr", lr, float("inf")), ("momentum", momentum, 1.0),
                                  ("weight_decay", weight_decay, float("inf")), ("eps", eps, float("inf"))):
            _check(name, value, 0.0, high)
        if trust_coefficient <= 0:
            raise ValueError(f"trust_coefficient must be > 0, got {trust_coefficient}")
        if nesterov and momentum == 0:
            raise ValueError("nesterov=True needs momentum > 0")
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay,
                                      trust_coefficient=trust_coefficient, eps=eps, nesterov=nesterov, adapt=True))

    @torch.no_grad()
    def step(self, closure=None):
        loss = _closure_loss(closure)
        for group, params, grads in _groups_with_grads(self):
            lr, mu, wd = group["lr"], group["momentum"], group["weight_decay"]
            # d = g + wd*w, computed as torch.optim.SGD does (grad.add(param, alpha=wd)) so that groups match it
            d = torch._foreach_add(grads, params, alpha=wd) if wd != 0 else grads
            if group["adapt"]:
                w_norm, g_norm = _norms(params), _norms(grads)
                local = group["trust_coefficient"] * w_norm / (g_norm + wd * w_norm + group["eps"])
                d = torch._foreach_mul(d, list(_ratio(w_norm, g_norm, local).unbind()))
            if mu != 0:
                bufs = []
                for p, dp in zip(params, d):
                    state = self.state[p]
                    if "momentum_buffer" not in state:
                        state["momentum_buffer"] = dp.clone()
                    else:
                        state["momentum_buffer"].mul_(mu).add_(dp)
                    bufs.append(state["momentum_buffer"])
                d = torch._foreach_add(d, bufs, alpha=mu) if group["nesterov"] else bufs
            torch._foreach_add_(params, d, alpha=-lr)
        return loss


class Lamb(torch.optim.Optimizer):
    """Adam with decoupled weight decay and a layer-wise trust ratio; "adapt": False groups are torch AdamW."""

    def __init__(self, params, lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.0):
        for name, value, high in (("lr", lr, float("inf")), ("betas[0]", betas[0], 1.0), ("betas[1]", betas[1], 1.0),
                                  ("eps", eps, float("inf")), ("weight_decay", weight_decay, float("inf"))):
            _check(name, value, 0.0, high)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, adapt=True))

    @torch.no_grad()
    def step(self, closure=None):
        loss = _closure_loss(closure)
        for group, params, grads in _groups_with_grads(self):
            (b1, b2), lr, wd, eps = group["betas"], group["lr"], group["weight_decay"], group["eps"]
            for p in params:
                state = self.state[p]
                if not state:
                    state.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
                state["step"] += 1
            ms = [self.state[p]["exp_avg"] for p in params]
            vs = [self.state[p]["exp_avg_sq"] for p in params]
            # The moments exactly as torch.optim.Adam computes them (lerp_, then mul_ + addcmul_).
            torch._foreach_lerp_(ms, grads, 1 - b1)
            torch._foreach_mul_(vs, b2)
            torch._foreach_addcmul_(vs, grads, grads, value=1 - b2)
            steps, updates = [], []
            for p, m, v in zip(params, ms, vs):
                t = self.state[p]["step"]
                bc1, bc2 = 1 - b1**t, 1 - b2**t
                denom = (v.sqrt() / bc2**0.5).add_(eps)  # sqrt(v_hat) + eps
                if group["adapt"]:
                    r = (m / bc1).div_(denom)
                    if wd != 0:
                        r.add_(p, alpha=wd)
                    steps.append(p)
                    updates.append(r)
                else:
                    # Ratio 1: w - lr*(m_hat/denom + wd*w), written as AdamW's two ops so it matches it bitwise.
                    if wd != 0:
                        p.mul_(1 - lr * wd)
                    p.addcdiv_(m, denom, value=-lr / bc1)
            if steps:
                w_norm, r_norm = _norms(steps), _norms(updates)
                trust = _ratio(w_norm, r_norm, w_norm / r_norm)
                torch._foreach_mul_(updates, list(trust.unbind()))
                torch._foreach_add_(steps, updates, alpha=-lr)
        return loss
