"""The exact KL at a per-row temperature: the reference the tests hold interpolations and
solvers to (the package itself reads KL through `KLTerms`, `kl_curve` and the oracle)."""

from __future__ import annotations

import torch
from torch import Tensor

from noisy_temp_server.temperature.stats import KLTerms


def kl_to_clean(clean: Tensor, served: Tensor, temperature: float | Tensor) -> Tensor:
    """``[B]`` KL(p || softmax(served / T)) with p = softmax(clean), T a float or ``[B]``."""
    terms = KLTerms.from_logits(clean, served)
    t = torch.as_tensor(temperature, dtype=terms.served_shifted.dtype, device=clean.device)
    return terms.kl(t.expand(clean.shape[0]).reciprocal())
