"""Prompt logprobs on the OpenAI routes: the legacy completions shape of `echo` + `logprobs` and vLLM's
`prompt_logprobs` extension.

Owns:
  * `echo_logprobs`: the prompt's tokens in the legacy completions `logprobs` object (`tokens`, `token_logprobs`
    with null for the first token, `top_logprobs` with null for the first, `text_offset` from 0), which the
    generated tokens' entries then continue: what lm-evaluation-harness's `local-completions` reads for every
    loglikelihood and perplexity task;
  * `vllm_prompt_logprobs`: vLLM's shape, one entry per prompt token (null for the first) mapping token ids (as
    strings) to `{"logprob", "rank", "decoded_token"}` for the prompt token and the top-N;
  * `completion_extras` / `chat_extras`: both added to a response from the scores the worker sent back.
Does not own: computing the numbers (`fastar.engine.prompt_logprobs`, run by the scheduler on the worker thread from
the request's own prefill), parsing the request fields (`fields`, `openai_request`: `prompt_logprobs`, `echo`,
`max_tokens: 0`).
Never imports torch.
"""

from __future__ import annotations

from typing import Any

from fastar.serve import openai_request, shapes
from fastar.serve.api_error import APIError


def scores(turn: Any) -> Any:
    """The `PromptLogprobs` the worker sent with the first chunk; a 500 if the engine sent none (never an answer
    that silently lacks them)."""
    if turn.prompt_scores is None:
        raise APIError(500, "the engine returned no prompt logprobs", "server_error", code="generation_failed")
    return turn.prompt_scores


def echo_logprobs(tokenizer: Any, scored: Any, k: int) -> dict:
    """The prompt part of a legacy completions `logprobs` object (offsets into the echoed text, from 0)."""
    tokens, lps, tops, offsets, offset = [], [], [], [], 0
    for i, tid in enumerate(scored.token_ids):
        text, _ = shapes.token_text(tokenizer, tid)
        tokens.append(text)
        lps.append(scored.logprobs[i])
        tops.append(None if i == 0 else {shapes.token_text(tokenizer, t)[0]: v for t, v in scored.top[i][:k]})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def with_generated(prompt_part: dict, generated: dict | None) -> dict:
    """The prompt's entries followed by the generated tokens' (whose offsets already start after the prompt)."""
    return {key: values + list((generated or {}).get(key, [])) for key, values in prompt_part.items()}


def vllm_prompt_logprobs(tokenizer: Any, scored: Any, k: int) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: per prompt token, {token id: {logprob, rank, decoded_token}} for the token itself
    and the top `k` (so k or k + 1 entries); None for the first token."""
    out: list[dict | None] = [None]
    for i in range(1, len(scored.token_ids)):
        entry = {}
        for rank, (tid, lp) in enumerate(scored.top[i][:k], start=1):
            entry[str(tid)] = {"logprob": lp, "rank": rank, "decoded_token": shapes.token_text(tokenizer, tid)[0]}
        tid = scored.token_ids[i]
        entry[str(tid)] = {
            "logprob": scored.logprobs[i],
            "rank": scored.ranks[i],
            "decoded_token": shapes.token_text(tokenizer, tid)[0],
        }
        out.append(entry)
    return out


def echoes_logprobs(req: openai_request.CompletionRequest) -> bool:
    """Whether a completion's `logprobs` object starts with the prompt's tokens (`echo` with `logprobs`)."""
    return req.echo and req.logprobs is not None


def completion_extras(response: dict, req: openai_request.CompletionRequest, turn: Any, tokenizer: Any) -> dict:
    """A non-streamed completion with the prompt's logprobs: in its `logprobs` (echo) and `prompt_logprobs`."""
    choice = response["choices"][0]
    if echoes_logprobs(req):
        choice["logprobs"] = with_generated(echo_logprobs(tokenizer, scores(turn), req.logprobs), choice["logprobs"])
    if req.prompt_logprobs is not None:
        choice["prompt_logprobs"] = vllm_prompt_logprobs(tokenizer, scores(turn), req.prompt_logprobs)
    return response


def chat_extras(response: dict, req: openai_request.ChatRequest, turn: Any, tokenizer: Any) -> dict:
    """A non-streamed chat completion with vLLM's top-level `prompt_logprobs` (of the rendered prompt)."""
    if req.prompt_logprobs is not None:
        response["prompt_logprobs"] = vllm_prompt_logprobs(tokenizer, scores(turn), req.prompt_logprobs)
    return response
