"""Data parallelism: `LLM(data_parallel_size=N)` spawns replica processes (`replica.py`), routes
requests to them prefix-affinely (`routing.py`, shared with the data-parallel HTTP front) and
collects their outputs (`client.py`), over msgspec messages (`protocol.py`)."""
