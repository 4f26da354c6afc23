"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's): a prompt, or chat messages through the model's
template, to the token ids the engine would see, and token ids back to text, for clients that count
or look at tokens. Neither checks the context window: counting a prompt that is too long is the
point; ``max_model_len`` comes with the count."""

from __future__ import annotations

from kvserve.entrypoints.openai import serving
from kvserve.entrypoints.openai.chat import render_messages
from kvserve.entrypoints.openai.errors import bad_request
from kvserve.entrypoints.openai.models import resolve_model
from kvserve.entrypoints.openai.protocol import DetokenizeRequest, TokenizeRequest
from kvserve.entrypoints.openai.serving import ServerState


async def tokenize(req: TokenizeRequest, state: ServerState) -> dict:
    resolve_model(req.model, state.model_names)
    info = state.client.ready_info()
    if req.messages is not None:
        _, ids = await render_messages(req, info, state, add_special_tokens=bool(req.add_special_tokens))
    else:
        special = req.add_special_tokens is not False
        ids = await serving.run_tokenizer(state, lambda tok: tok.encode(req.prompt, add_special_tokens=special),
                                        len(req.prompt))
    return {"count": len(ids), "max_model_len": info.max_model_len, "tokens": ids}


async def detokenize(req: DetokenizeRequest, state: ServerState) -> dict:
    resolve_model(req.model, state.model_names)
    info = state.client.ready_info()
    vocab = len(info.tokenizer)
    if bad := [t for t in req.tokens if not 0 <= t < vocab][:3]:
        raise bad_request(f"tokens must be ids in [0, {vocab}); got {bad}", "tokens")
    text = await serving.run_tokenizer(state, lambda tok: tok.decode(req.tokens), len(req.tokens))
    return {"prompt": text}
