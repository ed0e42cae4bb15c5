"""Scoring a clean/served pair position by position: the scorer and its clean backend (in
process or remote), the served pair it scores, sampled completions, per-position records and
scores, the KL scoreboard with its standard errors, and greedy agreement."""
