"""The OpenAI-compatible HTTP server and the built-in web chat UI.

`server` (uvicorn, limits, static UI files, CLI glue), `app` (the Starlette app from a list of routes, the guard
in front of every route, error shapes, body reading), `routes` (the OpenAI routes), `worker` (the one thread that
owns the engine, the session pool for prefix reuse, metrics), `protocol` (request validation, response shapes,
SSE). Never imports torch: the engine arrives through the `engine_factory` the caller passes in.
"""

from __future__ import annotations

from fastar.serve.server import Server, add_arguments, run_from_args, serve

__all__ = ["Server", "serve", "add_arguments", "run_from_args"]
