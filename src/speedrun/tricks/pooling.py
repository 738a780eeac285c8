"""Max pooling without indices in evaluation.

What: a k x k max pool with stride k as a reshape and a max over each window, (B, C, H, W) -> (B, C, H/k, W/k)
(floor, as nn.MaxPool2d: a last partial row or column is dropped). The same values as nn.MaxPool2d, bit for bit:
only the kernel differs.
Why: CUDA's max_pool2d always computes and writes the argmax indices, an int64 per output (four times an fp16
output's bytes), which only a backward pass reads; max pooling was 29% of cifar10-94's GPU kernel time on an H100
(BENCHMARKS.md). In evaluation no backward pass comes, so the indices are pure cost. A CPU's kernel already skips
them where no gradient is needed.
Suggested: on where the final evaluation runs on a GPU; it never applies while gradients are recorded.
Interactions: none; TTA's six views per image all pool this way.
"""

from __future__ import annotations

import torch


def max_pool_index_free(x: torch.Tensor, k: int) -> torch.Tensor:
    """k x k max pool, stride k, of x (B, C, H, W) without indices; the memory layout of x is kept."""
    b, c, h, w = x.shape
    x = x[:, :, :h // k * k, :w // k * k]
    return x.unflatten(3, (w // k, k)).unflatten(2, (h // k, k)).amax((3, 5))


class IndexFreeEvalPool(torch.nn.MaxPool2d):
    """nn.MaxPool2d(k) that pools with max_pool_index_free when no gradient is recorded and the module is in eval
    mode, and as nn.MaxPool2d otherwise. `index_free=False` is nn.MaxPool2d exactly."""

    def __init__(self, k: int, index_free: bool = False):
        super().__init__(k)
        self.index_free = index_free

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.index_free and not self.training and not torch.is_grad_enabled():
            return max_pool_index_free(x, self.kernel_size)
        return super().forward(x)
