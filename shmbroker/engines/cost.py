"""The simulated engines' cost model: a batch's or an engine step's modeled seconds (`SimCost`), which the
simulated engine (`sim.py`), the continuous-batching model (`continuous.py`) and `bench pack` share."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..pack.contract import DEFAULT_STEP_TOKENS

PREFILL_TOKEN_SECONDS = 7.5e-6


@dataclass(frozen=True)
class SimCost:
    """The cost model: a batch's modeled seconds (keys of the simulated engine's `engine_settings`)."""

    batch_overhead_seconds: float = field(default=0.003, metadata={"help": "cost model: seconds per batch"})
    prefill_token_seconds: float = field(default=PREFILL_TOKEN_SECONDS, metadata={
        "help": "cost model: seconds per computed input token (cache misses)"})
    # a decode step costs DEFAULT_STEP_TOKENS prefill tokens, the rate the padded policy assumes by default
    decode_step_seconds: float = field(default=round(DEFAULT_STEP_TOKENS * PREFILL_TOKEN_SECONDS, 12), metadata={
        "help": "cost model: seconds per decoding step"})
    decode_token_seconds: float = field(default=2e-5, metadata={"help": "cost model: seconds per sequence per "
                                                                        "decoding step"})
    zero_cost: bool = field(default=False, metadata={"help": "every batch free (benchmarks of the broker itself)"})

    @property
    def step_tokens(self) -> float:
        """The prefill tokens one decode step costs (what a padded policy weighs with)."""
        return self.decode_step_seconds / self.prefill_token_seconds if self.prefill_token_seconds else float(DEFAULT_STEP_TOKENS)

    def seconds(self, computed_tokens: int, decode_steps: int, decode_seq_steps: int) -> float:
        if self.zero_cost:
            return 0.0
        return (self.batch_overhead_seconds + self.prefill_token_seconds * computed_tokens
                + self.decode_step_seconds * decode_steps + self.decode_token_seconds * decode_seq_steps)
