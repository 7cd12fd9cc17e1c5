"""The OpenAI-compatible HTTP server and the built-in web chat UI.

`server` (uvicorn, limits, static UI files, CLI glue), `app` (the Starlette app from a list of routes, the guard
in front of every route, error shapes, body reading), `routes` (the OpenAI routes), `worker` (the one thread that
owns the engine), `metrics` (what /metrics serves), `openai_request` (the OpenAI request bodies), `fields`
(the request fields every API shares), `thinking_mode`, `grammar_fields` (tools, formats and their grammar), `shapes`
(response shapes, SSE), `choice_turn` (one choice's reply as it streams), `api_error`; the agent APIs (`anthropic`,
`responses`, `turn`, `toolstream`), `admission`, `scoring`, `connection`. Never imports torch: the engine arrives
through the `engine_factory` the caller passes in.
"""

from __future__ import annotations

from fastar.serve.server import Server, add_arguments, run_from_args, serve

__all__ = ["Server", "serve", "add_arguments", "run_from_args"]
