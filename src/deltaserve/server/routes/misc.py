"""The routes around generation: `GET /v1/models`, `GET /v1/models/{id}`, `POST /tokenize`
(a prompt, or chat messages rendered as the chat route would without tools; an image part is
one `<|media_pad|>`, not decoded nor expanded),
`POST /detokenize`, `GET /health` (the process is up; never needs the key), `GET /ready` (the
engine thread answered a round trip) and `GET /metrics` (Prometheus, see `metrics.py`).
Tokenizing and detokenizing run on a worker thread.
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response

from ..errors import APIError
from ..protocol import DetokenizeRequest, TokenizeRequest
from ..state import State

router = APIRouter()


@router.get("/v1/models")
async def models(state: State):
    return {"object": "list", "data": [state.model_card()]}


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, state: State):
    state.check_model(model_id)
    return state.model_card()


@router.post("/tokenize")
async def tokenize(req: TokenizeRequest, state: State):
    state.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "give exactly one of prompt or messages", param="prompt")
    if req.prompt is not None:
        ids = await state.encode(req.prompt)
    else:
        ids = await state.chat_prompt(req.messages, None, True)
    return {"count": len(ids), "max_model_len": state.engine.max_model_len, "tokens": ids}


@router.post("/detokenize")
async def detokenize(req: DetokenizeRequest, state: State):
    state.check_model(req.model)
    return {"prompt": await state.decode(req.tokens)}


@router.get("/health")
async def health():
    return {"status": "ok"}


@router.get("/metrics")
async def prometheus(state: State):
    body, ctype = await state.metrics.render(state.engine)
    return Response(body, media_type=ctype)


@router.get("/ready")
async def ready(state: State):
    if state.engine.failure is not None:
        raise APIError(503, f"the engine failed: {state.engine.failure}", "service_unavailable")
    try:
        stats = await state.engine.call(lambda core: core.stats(), timeout=5.0)
    except Exception:
        raise APIError(503, "the engine did not answer", "service_unavailable") from None
    return {"status": "ready", "num_running": stats["num_running"], "num_waiting": stats["num_waiting"]}
