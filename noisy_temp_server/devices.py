"""Host data onto a device without making the host wait."""

from __future__ import annotations

import torch

__all__ = ["upload"]


def upload(host: torch.Tensor, device: torch.device, *, pin: bool) -> torch.Tensor:
    """``host`` (a CPU tensor) on ``device``, copied asynchronously. ``pin``: copy from pinned
    memory (on CUDA the copy then never blocks the host, and PyTorch's pinned-memory allocator
    keeps the block until the copy is done, so ``host`` may be dropped at once). On the CPU the
    result may be ``host`` itself."""
    if pin:  # a fresh block of the pinned allocator: no `pin_memory()` check of ``host``
        host = torch.empty(host.shape, dtype=host.dtype, pin_memory=True).copy_(host)
    return host.to(device, non_blocking=True)
