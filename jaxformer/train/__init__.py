"""Training: the optax step over an explicit state, the loop with checkpoints and resume, evaluation."""
