"""Offline calibration of a clean/served pair: generate, score, fit every rule and correction,
measure each on held-out prompts, and write the profile that says what to serve."""
