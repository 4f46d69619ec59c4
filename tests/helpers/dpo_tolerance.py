"""How close a DPO quantity must be to TRL's: 10x TRL's own float32 distance from float64, and never below
float32's rounding."""

import numpy as np

EPS32 = float(np.finfo(np.float32).eps)


def tolerance(peer32, exact, operands=0.0):
    """10x TRL's float32 distance from float64, relative to ``exact``, and never below float32's rounding of the
    result or of the operands it was computed from (``operands``: their summed magnitude). Rewards, margins and
    the loss are differences of log-probabilities of tens: TRL's own float32 error there can be far below their
    rounding, because its policy and reference passes round alike and cancel, which another correct float32
    implementation need not do."""
    return 10 * max(abs(peer32 - exact), EPS32 * abs(exact), EPS32 * operands) / abs(exact)


def reward_operands(beta, metrics):
    """The summed magnitude of the log-probabilities a pair's reward difference is taken of: policy and
    reference (about as large), chosen and rejected (log-probabilities are negative, so |mean| = mean |.|)."""
    return beta * 2 * (abs(metrics["logps/chosen"]) + abs(metrics["logps/rejected"]))
