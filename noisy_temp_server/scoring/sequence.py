"""`ScoringSequence`: a prompt and its completion as the scorer and the clean backend take it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["ScoringSequence"]


@dataclass(frozen=True)
class ScoringSequence:
    """Token ids of prompt + completion; positions from `prompt_length` on are scored."""

    token_ids: Sequence[int]
    prompt_length: int
    sequence_id: int

    def __post_init__(self) -> None:
        if not 1 <= self.prompt_length < len(self.token_ids):
            raise ValueError(
                f"sequence {self.sequence_id}: need 1 <= prompt_length < length, got "
                f"prompt_length {self.prompt_length} for {len(self.token_ids)} tokens "
                "(a completion needs at least one token)"
            )
