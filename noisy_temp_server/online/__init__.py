"""Online learning off the serving path, in the API process (imports nothing of `server/`).

- `policy_source`: `PolicySource`, where new requests get their policy (the estimator, or a
  `StaticPolicySource`), and `describe_policy`;
- `startup`: what the server starts its policy with, from the settings: a profile checked
  against the served pair, and the estimator with its shadow scorer;
- `estimator`: `OnlineEstimator`, which refits T* (and the bias, `bias`) from live records and
  publishes new policy versions;
- `shadow`: `ShadowScorer`, which scores sampled live traffic against the clean model and feeds
  the estimator, within a CPU budget (`cpu_budget`);
- `metrics`: `OnlineMetrics`, the policy gauges and the shadow scorer's metrics (injected
  registry); `heap`: the glibc malloc setting the refits need.
"""
