"""The engine: requests, sampling, scheduling and the offline `LLM` API."""
