"""A stand-in for vLLM's OpenAI-compatible server, for the router's fast tests: a real HTTP
server that answers ``/health`` and echoes each completion request with its node id.

``python -m tests.fake_openai NODE PORT``. ``POST /v1/completions`` and
``/v1/chat/completions`` answer ``{"node": NODE, "path": ..., "body": <the request body>}``;
with ``"stream": true`` they answer three server-sent events ``data: {"node": NODE, "i": i}``
0.2 s apart, then ``data: [DONE]``. Misbehaviour on request, for the router's failure tests:

- ``"hang": true`` never answers;
- ``"hang_after": N`` (with ``stream``) sends N events, then nothing more, never ending;
- ``"cut_after": N`` (with ``stream``) sends N events, then drops the connection mid-response,
  as a backend that dies does.

On SIGTERM the server gives in-flight requests 1 s, then cancels them (a hung request does not
hold the test's teardown).
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

HANG_S = 3600.0
"""How long "never" is (the test ends long before)."""


class Cut(Exception):
    """Raised inside a streaming answer: uvicorn then closes the connection mid-response."""


def make_app(node: str) -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"node": node}

    @app.get("/v1/models")
    async def models() -> dict[str, object]:
        return {"object": "list", "data": [{"id": "tiny", "owned_by": node}]}

    async def complete(request: Request) -> object:
        body = await request.json()
        if body.get("hang"):
            await asyncio.sleep(HANG_S)
        if body.get("stream"):

            async def events() -> AsyncIterator[bytes]:
                for i in range(3):
                    if i == body.get("hang_after"):
                        await asyncio.sleep(HANG_S)
                    if i == body.get("cut_after"):
                        raise Cut(f"cut after {i} events")
                    yield f"data: {json.dumps({'node': node, 'i': i})}\n\n".encode()
                    await asyncio.sleep(0.2)
                yield b"data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")
        return {"node": node, "path": request.url.path, "body": body}

    app.add_api_route("/v1/completions", complete, methods=["POST"])
    app.add_api_route("/v1/chat/completions", complete, methods=["POST"])
    return app


if __name__ == "__main__":
    uvicorn.run(
        make_app(sys.argv[1]), host="127.0.0.1", port=int(sys.argv[2]), log_level="warning", timeout_graceful_shutdown=1
    )
