"""The temperature maths core (torch only): logit statistics, the KL-optimal temperature, the
rules, and the versioned policy that turns a rule into a temperature per row."""

from noisy_temp_server.temperature.oracle import (
    ConvexObjective,
    OracleResult,
    kl_curve,
    minimise_convex,
    oracle_temperature,
)
from noisy_temp_server.temperature.policy import (
    CalibratedTable,
    PolicyValidationError,
    TemperaturePolicy,
)
from noisy_temp_server.temperature.policy_eval import bucket_index, policy_temperature
from noisy_temp_server.temperature.rules import (
    Rule,
    TemperatureBounds,
    clamp_temperature,
    fisher_temperature,
    linear_temperature,
    schedule_temperature,
    sqrt_temperature,
)
from noisy_temp_server.temperature.stats import (
    KLTerms,
    NonFiniteLogitsError,
    PairStatistics,
    PairTerms,
    ServedRowFeatures,
    check_logits,
    pair_statistics,
    served_row_features,
    stable_log_softmax,
)

__all__ = [
    "CalibratedTable",
    "ConvexObjective",
    "KLTerms",
    "NonFiniteLogitsError",
    "OracleResult",
    "PairStatistics",
    "PairTerms",
    "PolicyValidationError",
    "Rule",
    "ServedRowFeatures",
    "TemperatureBounds",
    "TemperaturePolicy",
    "bucket_index",
    "check_logits",
    "clamp_temperature",
    "fisher_temperature",
    "kl_curve",
    "linear_temperature",
    "minimise_convex",
    "oracle_temperature",
    "pair_statistics",
    "policy_temperature",
    "schedule_temperature",
    "served_row_features",
    "sqrt_temperature",
    "stable_log_softmax",
]
