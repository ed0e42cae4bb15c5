"""Where new requests get their temperature policy, and how a policy is described.

`PolicySource` is the one protocol of a policy holder: the server asks it at each admission;
`online.estimator.OnlineEstimator` is one (it refits the policy from live traffic),
`StaticPolicySource` another (a profile's policy, or the identity, that never changes).
`describe_policy` is what `/v1/nts/status` and the policy gauges (`online.metrics`) report of
a policy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from noisy_temp_server.temperature.policy import TemperaturePolicy, step_bucket_labels

__all__ = ["PolicySource", "StaticPolicySource", "describe_policy"]


class PolicySource(Protocol):
    """Where new requests get their policy: `current_policy` is an immutable snapshot, safe to
    call from any thread; `status` is JSON-ready."""

    def current_policy(self) -> TemperaturePolicy: ...

    def status(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class StaticPolicySource:
    """A policy that never changes (a profile's, or the identity when there is no estimator);
    `origin` says where it came from, in words."""

    policy: TemperaturePolicy
    origin: str

    def current_policy(self) -> TemperaturePolicy:
        return self.policy

    def status(self) -> dict[str, Any]:
        return {"enabled": False, "origin": self.origin}


def describe_policy(policy: TemperaturePolicy) -> dict[str, Any]:
    """Version, rule, α/σ² by step bucket label and the sha256 of the per-token bias (None:
    none), for `/v1/nts/status` and the gauges."""
    labels = step_bucket_labels(policy.step_edges)
    return {
        "policy_version": policy.version,
        "rule": policy.rule.value,
        "alpha_by_step_bucket": dict(zip(labels, policy.alpha_by_step, strict=True)),
        "sigma2_by_step_bucket": dict(zip(labels, policy.sigma2_by_step, strict=True)),
        "bias": policy.bias,
    }
