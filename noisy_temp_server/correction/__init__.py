"""Corrections of the served logits beyond a temperature (torch only): the per-token bias fitted
with T*, the head map under it, their online refinement, request-temperature bands, their files."""
