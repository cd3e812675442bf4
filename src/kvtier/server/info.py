"""The routes that describe the served model and its tokenizer: `/v1/models`, `/tokenize`,
`/detokenize`, `/version`. They read the `EngineClient`'s tokenizer and limits; nothing is generated."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from fastapi import APIRouter

import kvtier
from kvtier.server.errors import APIError, JSONBody, check_text
from kvtier.server.events import EngineClient
from kvtier.server.prompts import ChatOptions, Prompt, encode
from kvtier.server.protocol import DetokenizeRequest, TokenizeRequest, check_extras, message_dicts


def check_model(name: str | None, served_model_name: str) -> None:
    """Refuse (404) a body naming a model other than the one served; no name is the served one."""
    if name is not None and name != served_model_name:
        raise APIError(
            f"The model `{name}` does not exist.", 404, param="model", code="model_not_found"
        )


def info_routes(engine: EngineClient, served_model_name: str) -> APIRouter:
    """`/v1/models` (one model card, `served_model_name`), `/tokenize`, `/detokenize` and
    `/version` over a started `engine`."""
    router = APIRouter(default_response_class=JSONBody)
    created = int(time.time())
    # vLLM's model card: clients read `root` (the weights' folder, where a tokenizer loads from)
    card = {
        "id": served_model_name,
        "object": "model",
        "created": created,
        "owned_by": "kvtier",
        "root": str(engine.args.model_path),
        "parent": None,
        "max_model_len": engine.max_model_len,
        "permission": [
            {
                "id": f"modelperm-{uuid.uuid4().hex}",
                "object": "model_permission",
                "created": created,
                "allow_create_engine": False,
                "allow_sampling": True,
                "allow_logprobs": True,
                "allow_search_indices": False,
                "allow_view": True,
                "allow_fine_tuning": False,
                "organization": "*",
                "group": None,
                "is_blocking": False,
            }
        ],
    }

    @router.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [card]}

    @router.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        check_model(model_id, served_model_name)
        return card

    @router.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        check_text(body.model_dump(exclude_unset=True), "")
        check_extras(body.extras(), {})
        check_model(body.model, served_model_name)
        if (body.prompt is None) == (body.messages is None):
            raise APIError("send exactly one of `prompt` and `messages`")
        prompt: Prompt = (
            body.prompt if body.prompt is not None else message_dicts(body.messages or [])
        )
        tok = engine.tokenizer
        assert tok is not None
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        ids = (
            await asyncio.to_thread(
                lambda: encode(
                    tok,
                    prompt,
                    engine.vocab_size,
                    body.add_generation_prompt,
                    body.add_special_tokens,
                    max_model_len=engine.max_model_len,
                    max_tokens=0,
                    chat=ChatOptions(body.add_generation_prompt, tools=tools),
                )
            )
        ).token_ids
        strs = [tok.tokenizer.id_to_token(t) for t in ids] if body.return_token_strs else None
        return {
            "count": len(ids),
            "max_model_len": engine.max_model_len,
            "tokens": ids,
            "token_strs": strs,
        }

    @router.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        check_extras(body.extras(), {})
        check_model(body.model, served_model_name)
        if any(not 0 <= t < engine.vocab_size for t in body.tokens):
            raise APIError(f"token ids must lie in [0, {engine.vocab_size})", param="tokens")
        tok = engine.tokenizer
        assert tok is not None
        text = await asyncio.to_thread(tok.decode, body.tokens, False)  # specials kept (vLLM)
        return {"prompt": text}

    @router.get("/version")
    async def version() -> dict[str, Any]:
        return {"version": kvtier.__version__}

    return router
