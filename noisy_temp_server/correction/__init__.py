"""Corrections of the served logits beyond a temperature (torch only): the per-token bias fitted
with T*, its online refinement, request-temperature bands and its files."""
