"""What the logits processors do on every decode step, free of vLLM (torch, numpy and the
standard library only): per-slot temperature state, the bias and head map, the reports."""
