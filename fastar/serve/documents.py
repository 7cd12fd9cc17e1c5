"""Text documents attached to a turn: Anthropic `document` blocks, chat completions `file` parts and Responses
`input_file` parts whose content is plain text, checked and rendered into the turn's text.

Owns `render()`, the one form every API's document takes in the prompt (deterministic, so a resent conversation
renders the same text and the prefix cache keeps it):

    <document>
    <title>{title}</title>          (only when a title / filename is given and not empty)
    <context>{context}</context>    (Anthropic's `context`, same rule)
    <content>
    {text}
    </content>
    </document>

The text is put in verbatim, never escaped: the tags are there for the model to read where a document starts and
ends, not a boundary it is held to (a document is user content, as the turn's text is; its characters are
tokenized as plain text, never as the template's control tokens).

What is read:
- Anthropic `document` blocks of source `{"type": "text", "media_type": "text/plain", "data"}` or
  `{"type": "content", "content": string | [text blocks]}` (the text blocks joined with newlines), with optional
  `title` and `context`. `citations` `{"enabled": true}` is a 400: the server never returns citation blocks, so a
  client relying on them would get none without a word. Base64 (PDF), URL and Files API (`file`) sources are a 400.
- OpenAI file parts (`{"type": "file", "file": {...}}` on chat completions, `{"type": "input_file", ...}` on
  Responses) whose `file_data` is a data URL (`data:<media type>[;charset=utf-8][;base64],<data>`) of a text type:
  `text/*`, `application/json`, `application/xml`, `application/yaml`, ... and any `+json` / `+xml` type. The bytes
  must be UTF-8 (a leading byte-order mark is dropped); `filename` is the title. `file_id` (no Files API here),
  `file_url` (the server fetches nothing), other media types and bytes that are not UTF-8 are a 400 naming the part.

The decoded text is at most the request body's size (base64 decodes to 3/4 of its length, a percent-encoded URL
to at most its length), which the body limit bounds, and it is part of the rendered prompt the admission guard
(`fastar.serve.admission`) measures before tokenizing.

Does not own: where a document may stand in each API's request (`fastar.serve.anthropic`, `fastar.serve.responses`,
`fastar.serve.openai_request`). Pure Python; never imports torch.
"""

from __future__ import annotations

import base64
import binascii
import re
import urllib.parse
from typing import Any

from fastar.serve import fields
from fastar.serve.api_error import bad_request

# application/* types whose bytes are text; with `text/*` and the `+json` / `+xml` suffixes, what a file may be
TEXT_APPLICATION_TYPES = frozenset(
    {
        "application/json",
        "application/ld+json",
        "application/x-ndjson",
        "application/jsonl",
        "application/xml",
        "application/yaml",
        "application/x-yaml",
        "application/toml",
        "application/javascript",
        "application/x-javascript",
        "application/typescript",
        "application/x-python",
        "application/x-sh",
        "application/sql",
        "application/csv",
        "application/x-tex",
        "application/x-latex",
    }
)
_CHARSETS = ("utf-8", "utf8", "us-ascii", "ascii")
_WHITESPACE = re.compile(r"[ \t\r\n]+")


def render(text: str, title: str | None = None, context: str | None = None) -> str:
    """A document as the model reads it (the form in the module docstring)."""
    lines = ["<document>"]
    if title:
        lines.append(f"<title>{title}</title>")
    if context:
        lines.append(f"<context>{context}</context>")
    lines += ["<content>", text, "</content>", "</document>"]
    return "\n".join(lines)


def is_text_type(media_type: str) -> bool:
    """Whether a file of this media type (lower case, no parameters) is read as text."""
    return (
        media_type.startswith("text/") or media_type in TEXT_APPLICATION_TYPES or media_type.endswith(("+json", "+xml"))
    )


def _optional_string(obj: dict, key: str, at: str, param: str) -> str | None:
    value = obj.get(key)
    if value is not None and not isinstance(value, str):
        raise bad_request(f"{at}.{key} must be a string, got {fields.shown(value)}", param)
    return value


# ---------------------------------------------------------------------------------------------------------
# Anthropic Messages: `document` blocks
# ---------------------------------------------------------------------------------------------------------


def anthropic_document(block: dict, at: str, param: str = "messages") -> str:
    """A `document` block at `at` ("messages[0].content[1]") as rendered text, or a 400 naming what is wrong."""
    title = _optional_string(block, "title", at, param)
    context = _optional_string(block, "context", at, param)
    citations = block.get("citations")
    if citations is not None:
        if not isinstance(citations, dict) or not isinstance(citations.get("enabled", False), bool):
            raise bad_request(
                f'{at}.citations must be {{"enabled": true | false}}, got {fields.shown(citations)}', param
            )
        if citations.get("enabled"):
            raise bad_request(
                f"{at}.citations: citations are not supported (this server never returns citation blocks); "
                "leave 'citations' out or send {\"enabled\": false}",
                param,
            )
    source = block.get("source")
    if not isinstance(source, dict):
        raise bad_request(f"{at}: a document block needs a 'source' object", param)
    kind = source.get("type")
    if kind == "text":
        if source.get("media_type") != "text/plain":
            raise bad_request(
                f'{at}.source.media_type must be "text/plain" for a text source, got '
                f"{fields.shown(source.get('media_type'))}",
                param,
            )
        text = _optional_string(source, "data", f"{at}.source", param)
        if text is None:
            raise bad_request(f"{at}.source: a text source needs a string 'data'", param)
    elif kind == "content":
        text = _content_source(source.get("content"), f"{at}.source.content", param)
    else:
        what = {
            "base64": f"a base64 document ({fields.shown(source.get('media_type'))})",
            "url": "a document by URL",
            "file": "a document by file_id (Files API)",
        }.get(kind, f"a document source of type {fields.shown(kind)}")
        raise bad_request(
            f"{at}: {what} is not read: only plain-text documents are (a source of type 'text' with media_type "
            "\"text/plain\", or of type 'content' holding text blocks)",
            param,
        )
    return render(text, title, context)


def _content_source(content: Any, at: str, param: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{at} must be a string or a list of text blocks, got {fields.shown(content)}", param)
    texts = []
    for k, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind != "text":
            raise bad_request(
                f"{at}[{k}]: only text blocks are read in a document, got {fields.shown(kind)} "
                "(the model reads text only)",
                param,
            )
        if not isinstance(block.get("text"), str):
            raise bad_request(f"{at}[{k}]: a text block needs a string 'text'", param)
        texts.append(block["text"])
    return "\n".join(texts)


# ---------------------------------------------------------------------------------------------------------
# OpenAI: chat completions `file` parts, Responses `input_file` parts
# ---------------------------------------------------------------------------------------------------------


def openai_file(spec: Any, at: str, param: str) -> str:
    """A file's fields (chat completions: the part's `file` object; Responses: the `input_file` part itself) at
    `at` as rendered text, or a 400 naming the part and saying why it is not read."""
    if not isinstance(spec, dict):
        raise bad_request(f"{at} must be an object with 'file_data' and 'filename', got {fields.shown(spec)}", param)
    filename = _optional_string(spec, "filename", at, param)
    if spec.get("file_id") is not None:
        raise bad_request(
            f"{at}: a file by 'file_id' is not read: this server has no Files API (send the text in 'file_data', "
            "a data URL such as data:text/plain;base64,...)",
            param,
        )
    if spec.get("file_url") is not None:
        raise bad_request(
            f"{at}: a file by 'file_url' is not read: this server fetches nothing (send the text in 'file_data', "
            "a data URL such as data:text/plain;base64,...)",
            param,
        )
    data = spec.get("file_data")
    if not isinstance(data, str):
        raise bad_request(
            f"{at}: a file needs 'file_data', a data URL such as data:text/plain;base64,..., got {fields.shown(data)}",
            param,
        )
    return render(_data_url_text(data, at, param), filename)


def _data_url_text(url: str, at: str, param: str) -> str:
    """The text a data URL (RFC 2397) holds: a text media type, base64 or percent-encoded, UTF-8."""
    header, comma, payload = url.partition(",")
    if not header.startswith("data:") or not comma:
        raise bad_request(
            f"{at}.file_data must be a data URL (data:<media type>;base64,<data>), got {fields.shown(url)}", param
        )
    params = [p.strip().lower() for p in header[5:].split(";")]
    media = params[0] or "text/plain"  # RFC 2397's default
    encoded = len(params) > 1 and params[-1] == "base64"
    for extra in params[1 : len(params) - encoded]:
        name, _, value = extra.partition("=")
        if name == "charset" and value.strip('"') not in _CHARSETS:
            raise bad_request(f"{at}: a file in charset {fields.shown(value)} is not read (UTF-8 text only)", param)
    if not is_text_type(media):
        raise bad_request(
            f"{at}: a file of type {fields.shown(media)} is not read: only text files are (text/*, "
            "application/json, application/xml, application/yaml, ...; the model reads text only)",
            param,
        )
    if encoded:
        try:
            raw = base64.b64decode(_WHITESPACE.sub("", payload), validate=True)
        except (binascii.Error, ValueError):
            raise bad_request(f"{at}.file_data: the data after ';base64,' is not valid base64", param) from None
    else:
        raw = urllib.parse.unquote_to_bytes(payload)
    bom = 3 if raw.startswith(b"\xef\xbb\xbf") else 0  # a byte-order mark says nothing the model should read
    try:
        return raw[bom:].decode("utf-8")
    except UnicodeDecodeError as err:
        raise bad_request(
            f"{at}: the file's bytes are not UTF-8 text (byte {raw[bom + err.start]:#04x} at offset {bom + err.start})",
            param,
        ) from None


def inline_chat_files(messages: list[dict]) -> list[dict]:
    """Chat completions `messages` with each user message's `file` parts replaced by text parts holding the
    rendered document (the encoder joins a message's parts with newlines). A `file` part in another role's message
    is a 400 naming the message and part (files are read only in user messages, as OpenAI allows them)."""
    out = []
    for i, msg in enumerate(messages):
        content = msg.get("content")
        if not isinstance(content, list):
            out.append(msg)
            continue
        if msg.get("role") != "user":
            for j, part in enumerate(content):
                if isinstance(part, dict) and part.get("type") == "file":
                    raise bad_request(
                        f"messages[{i}].content[{j}]: a file part in a {fields.shown(msg.get('role'))} message is "
                        "not read: files are read only in user messages",
                        "messages",
                    )
            out.append(msg)
            continue
        parts = [
            {"type": "text", "text": openai_file(part.get("file"), f"messages[{i}].content[{j}].file", "messages")}
            if isinstance(part, dict) and part.get("type") == "file"
            else part
            for j, part in enumerate(content)
        ]
        out.append({**msg, "content": parts})
    return out
