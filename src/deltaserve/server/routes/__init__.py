"""The HTTP routes, one `APIRouter` per module: `chat.py` (`/v1/chat/completions`),
`completions.py` (`/v1/completions`), `misc.py` (models, tokenize / detokenize, health, ready,
metrics); `common.py` holds what the generation routes share (SSE framing, collection of a
non-streaming response, usage). Routes reach the shared `ServerState` through `state.State`.
"""
