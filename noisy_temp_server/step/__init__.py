"""What the logits processors do on every decode step, free of vLLM (torch, numpy, the standard
library and prometheus-client only: `tests/unit/test_step_imports.py`): per-slot temperature
tables and the step (`slot_tables`, `slot_tuning`), the per-token bias (`logit_bias`), the
capture of served rows (`capture`, `batch_rows`), the reports (`reports`, `engine_metrics`)."""
