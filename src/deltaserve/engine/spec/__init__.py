"""Speculative decoding (empty until that issue): proposers of draft tokens and the verification
of several new tokens per sequence in one step. Sits above `engine.exec`, which it will drive to
run drafts, and below `engine.core`, whose loop will call it."""
