"""Speculative decoding: proposers of draft tokens (proposer.py: the protocol; drafters.py:
model-free; draft_model.py: a second checkpoint), the verification of several new tokens per
sequence in one step (verify.py, decoder.py) and the fold of only the verified ones into the KDA
state. Sits above `engine.exec`, which runs its verify steps, and below `engine.core`, whose loop
calls it."""
