"""The Responses API's stored responses besides retrieval: `DELETE /v1/responses/{id}` (`delete`, OpenAI's deletion
object) and `GET /v1/responses/{id}/input_items` (`list_input_items`, OpenAI's list object paged by `order`, `limit`
and `after`), and the input items a stored response keeps (`input_items`: the request's own `input` as items with
ids, an `item_reference` replaced by the item it names; the turns of a `previous_response_id` are that response's).

Does not own: the store (`fastar.serve.responses.ResponseStore`), reading `input` into the conversation
(`fastar.serve.responses.input_messages`, which has checked it before `input_items` runs). Pure Python.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

from fastar.serve.api_error import APIError, bad_request

MAX_LIMIT = 100  # OpenAI's bounds on `limit` (default 20)
DEFAULT_LIMIT = 20
_PREFIX = {"message": "msg_", "function_call": "fc_", "function_call_output": "fco_", "reasoning": "rs_"}


def input_items(value: Any, store: Any) -> list[dict]:
    """`input` (checked) as OpenAI lists a response's input items: a string is one user message, a message's string
    content one text part (`input_text`; `output_text` for the assistant's), each item without an `id` gets one, and
    an `item_reference` is the stored item it names."""
    items = [{"type": "message", "role": "user", "content": value}] if isinstance(value, str) else value
    out = []
    for item in items:
        kind = item.get("type", "message")
        if kind == "item_reference":
            found = store.item(item["id"])
            out.append(dict(found) if found is not None else dict(item))
            continue
        item = {**item, "type": kind}
        if kind == "message":
            if isinstance(item.get("content"), str):
                part = "output_text" if item.get("role") == "assistant" else "input_text"
                item["content"] = [{"type": part, "text": item["content"]}]
            item.setdefault("status", "completed")
        if not isinstance(item.get("id"), str) or not item["id"]:
            item["id"] = _PREFIX.get(kind, "item_") + uuid.uuid4().hex
        out.append(item)
    return out


def not_found(response_id: str) -> APIError:
    """The 404 of an id not stored (retrieve, delete, input_items)."""
    return APIError(
        404,
        f"No response with id {response_id[:80]!r} is stored on this server",
        param="response_id",
        code="response_not_found",
    )


def delete(response_id: str, store: Any) -> dict:
    """`DELETE /v1/responses/{id}`: the stored response is gone (neither retrievable nor continued from); an id not
    stored is a 404."""
    if not store.delete(response_id):
        raise not_found(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


def list_input_items(response_id: str, store: Any, query: Mapping[str, str]) -> dict:
    """`GET /v1/responses/{id}/input_items?order=&limit=&after=`: a page of the stored response's input items, newest
    first unless `order=asc` (OpenAI's default `desc`), at most `limit` (1-100, default 20), after the item `after`
    in that order. A bad value is a 400 naming it; an id not stored, or an `after` not among the items, a 404."""
    found = store.get(response_id)
    if found is None:
        raise not_found(response_id)
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad_request(f"'order' must be 'asc' or 'desc', got {order[:40]!r}", "order")
    raw = query.get("limit", str(DEFAULT_LIMIT))
    try:
        limit = int(raw)
    except ValueError:
        raise bad_request(f"'limit' must be an integer, got {raw[:40]!r}", "limit") from None
    if not 1 <= limit <= MAX_LIMIT:
        raise bad_request(f"'limit' must be between 1 and {MAX_LIMIT}, got {limit}", "limit")
    items = list(found[1].get("_input_items") or [])
    if order == "desc":
        items.reverse()
    start = 0
    after = query.get("after")
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise APIError(
                404,
                f"No input item with id {after[:80]!r} in response {response_id[:80]!r}",
                param="after",
                code="not_found",
            )
        start = ids.index(after) + 1
    page = items[start : start + limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": start + limit < len(items),
    }
