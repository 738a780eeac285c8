"""Patch-whitening initialization of the first convolution (Page, "How to train your ResNet" part 8: 36 s ->
the same accuracy in fewer epochs; airbench sec. 3.2; the idea goes back to Coates & Ng 2011).

What: the k x k x C patches of (a sample of) the standardized training images have covariance Sigma
((C*k*k) x (C*k*k)). With Sigma = V diag(lambda) V^T, the first conv's filters are the rows of
diag(1/sqrt(lambda + eps)) V^T, so its outputs on training patches have covariance ~ identity; the filters are
stacked with their negatives (2*C*k*k channels) so that the following GELU keeps both signs.
Why: the first layer starts as a fixed, well-conditioned feature map; it is frozen and only its bias learns
(for the first whiten_bias_epochs; airbench: 3 epochs, worth 5-10% fewer steps).
Suggested: k = 2, eps = 5e-4, 5,000 images (airbench94). Interactions: the conv must have no padding and
2*C*k*k output channels.
method="svd" (Hiverge's 2025 record, hiverge/cifar10-speedrun README "Model architecture"): the basis from the
SVD of the covariance instead of its eigendecomposition. For a symmetric positive semi-definite Sigma both give
its eigenvectors, so the filters agree up to each filter's sign (and a rotation within equal eigenvalues): the
whitened covariance is the identity either way, and W^T W = (Sigma + eps I)^-1 for both.
"""

from __future__ import annotations

import torch
from torch import nn


def svd_whitening_filters(covariance: torch.Tensor, eps: float) -> torch.Tensor:
    """(d, d) covariance -> (d, d) whitening filters as rows, largest singular value first (SVD's own order)."""
    _, singular_values, basis = torch.linalg.svd(covariance)  # Sigma = U S V^T; V^T's rows are eigenvectors
    return basis / torch.sqrt(singular_values + eps).unsqueeze(1)


def patch_covariance(images: torch.Tensor, kernel_px: int) -> torch.Tensor:
    """images: (N, C, H, W) float -> covariance of all k x k patches, (C*k*k, C*k*k) in float64.

    Like airbench, the second moment about zero: the inputs are already standardized to zero mean.
    """
    n, c, _, _ = images.shape
    patches = images.double().unfold(2, kernel_px, 1).unfold(3, kernel_px, 1)  # (N, C, H', W', k, k)
    patches = patches.permute(0, 2, 3, 1, 4, 5).reshape(-1, c * kernel_px * kernel_px)  # (N*H'*W', C*k*k)
    return patches.T @ patches / patches.shape[0]


WHITEN_METHODS = ("eigh", "svd")


@torch.no_grad()
def patch_whitening_init_(conv: nn.Conv2d, images: torch.Tensor, eps: float = 5e-4,
                          method: str = "eigh") -> nn.Conv2d:
    """Set conv.weight (2*C*k*k, C, k, k) to the whitening filters of `images` and their negatives."""
    k = conv.kernel_size[0]
    c = conv.in_channels
    assert conv.out_channels == 2 * c * k * k, "whitening conv needs 2*C*k*k output channels"
    if method == "eigh":
        eigenvalues, eigenvectors = torch.linalg.eigh(patch_covariance(images, k))  # ascending
        filters = (eigenvectors.T / torch.sqrt(eigenvalues.clamp_min(0) + eps).unsqueeze(1))  # (C*k*k, C*k*k)
        filters = filters.flip(0)  # largest eigenvalue first
    elif method == "svd":
        filters = svd_whitening_filters(patch_covariance(images, k), eps)
    else:
        raise ValueError(f"whiten_method must be one of {', '.join(WHITEN_METHODS)}, got {method!r}")
    filters = filters.reshape(c * k * k, c, k, k)  # as (out, C, k, k)
    conv.weight.copy_(torch.cat([filters, -filters]).to(conv.weight.dtype))
    return conv


def whitenable_first_conv(model: nn.Module, in_channels: int) -> nn.Conv2d | None:
    """The first conv of `model` (in module order) where patch_whitening_init_ can initialize it: in_channels ->
    2*C*k*k, a square k x k kernel, stride 1, no padding or dilation, not grouped; None otherwise (a network
    whose first layer is a 3x3 conv with padding, a patch embedding with stride, ...)."""
    first = next((m for m in model.modules() if isinstance(m, nn.Conv2d)), None)
    if first is None:
        return None
    k = first.kernel_size[0]
    fits = (first.kernel_size == (k, k) and first.in_channels == in_channels and first.groups == 1
            and first.out_channels == 2 * in_channels * k * k and first.stride == (1, 1)
            and first.padding in ((0, 0), "valid") and first.dilation == (1, 1))
    return first if fits else None
