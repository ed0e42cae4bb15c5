"""The temperature maths core (torch only): logit statistics, the KL-optimal temperature, the
rules, and the versioned policy that turns a rule into a temperature per row."""

from noisy_temp_server.temperature.oracle import (
    LogitPairChunk,
    OracleResult,
    SharedTemperatureResult,
    best_shared_temperature,
    kl_curve,
    oracle_temperature,
)
from noisy_temp_server.temperature.policy import (
    CalibratedTable,
    PolicyValidationError,
    TemperaturePolicy,
    bucket_index,
    policy_temperature,
)
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
    ServedRowFeatures,
    check_logits,
    kl_to_clean,
    pair_statistics,
    served_row_features,
    stable_log_softmax,
)

__all__ = [
    "CalibratedTable",
    "KLTerms",
    "LogitPairChunk",
    "NonFiniteLogitsError",
    "OracleResult",
    "PairStatistics",
    "PolicyValidationError",
    "Rule",
    "ServedRowFeatures",
    "SharedTemperatureResult",
    "TemperatureBounds",
    "TemperaturePolicy",
    "best_shared_temperature",
    "bucket_index",
    "check_logits",
    "clamp_temperature",
    "fisher_temperature",
    "kl_curve",
    "kl_to_clean",
    "linear_temperature",
    "oracle_temperature",
    "pair_statistics",
    "policy_temperature",
    "schedule_temperature",
    "served_row_features",
    "sqrt_temperature",
    "stable_log_softmax",
]
