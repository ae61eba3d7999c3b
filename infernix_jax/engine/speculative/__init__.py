"""Speculative decoding: drafters propose, one verify forward accepts 1..k+1 tokens per row.

- drafters.py: n-gram (prompt lookup), MTP, both combined (host-side proposers)
- verify.py: greedy and exact rejection-sampling acceptance (pure, jitted inside the programs)
- rollback.py: keep the GDN state at each row's accepted length (no recompute); state memory
- mtp.py: the MTP head chained for several draft tokens
- programs.py / step.py: the verify program and the engine step that drives it

See docs/speculative.md.
"""

from infernix_jax.engine.speculative.drafters import (
    SPEC_METHODS,
    CombinedDrafter,
    Drafter,
    MtpDrafter,
    NgramDrafter,
    make_drafter,
    ngram_lookup,
)
from infernix_jax.engine.speculative.verify import VerifyOutput, greedy_accepted_length, verify_window

__all__ = [
    "SPEC_METHODS",
    "CombinedDrafter",
    "Drafter",
    "MtpDrafter",
    "NgramDrafter",
    "VerifyOutput",
    "greedy_accepted_length",
    "make_drafter",
    "ngram_lookup",
    "verify_window",
]
