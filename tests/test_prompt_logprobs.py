"""Prompt logprobs (`Engine.prompt_logprobs`, `SamplingParams.prompt_logprobs` through the scheduler): every prompt
token's logprob, rank and top-N against transformers' log_softmax on the same weights (`reference` numerics), against
the engine's own full logits (`official`), and the scheduler's numbers against the plain engine call while other
requests decode beside it."""

from __future__ import annotations

import pytest
import torch
from batch_helpers import prompt, solo

from fastar.engine.engine import load
from fastar.engine.prompt_logprobs import HEAD_ROWS
from fastar.engine.sampling import SamplingParams
from fastar.engine.session import PromptError
from fastar.model import ops

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def eng(tiny_ckpt):
    return load(tiny_ckpt)  # official numerics


def full_logprobs(eng, ids: list[int]) -> torch.Tensor:
    """log_softmax of the engine's logits at every position: [len, V]."""
    return torch.log_softmax(torch.from_numpy(eng.logits(ids)), dim=-1)


def test_prompt_logprobs_match_transformers(tiny_ckpt):
    """`reference` numerics: every prompt token's logprob and its top-5 within 1e-4 of transformers' log_softmax
    on the same weights; ranks as transformers orders the vocabulary; nothing for the first token."""
    from transformers import DeepseekV4ForCausalLM

    ids = prompt(5, 200)
    ours = load(tiny_ckpt, numerics="reference").prompt_logprobs(ids, top=5)
    hf = DeepseekV4ForCausalLM.from_pretrained(str(tiny_ckpt), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)  # [200, V]
    want = ref[torch.arange(199), torch.tensor(ids[1:])]  # position p scores token p + 1
    assert ours.logprobs[0] is None and ours.top[0] == [] and ours.ranks[0] is None
    got = torch.tensor(ours.logprobs[1:])
    assert (got - want).abs().max().item() <= 1e-4
    top_vals = torch.tensor([[v for _, v in t] for t in ours.top[1:]])
    assert (top_vals - ref[:-1].topk(5, dim=-1).values).abs().max().item() <= 1e-4
    ranks = (ref[:-1] > want[:, None]).sum(1) + 1  # a tie within 1e-4 could move a rank by one
    assert (torch.tensor(ours.ranks[1:]) - ranks).abs().max().item() <= 1
    assert ours.total() == pytest.approx(want.sum().item(), abs=1e-2)


def test_prompt_logprobs_are_the_engine_logits_in_any_chunking(eng, monkeypatch):
    """`official` numerics: bit for bit log_softmax of `Engine.logits` with the same prefill chunks (512 or 40
    tokens: under `official` the chunking moves FP8 rounding); the LM head never sees more than HEAD_ROWS +
    SMALL_CHUNK positions at once (no prompt x vocab tensor)."""
    ids = prompt(6, 300)
    rows = []
    head = eng.model.head_logits
    for chunk in (512, 40):
        monkeypatch.setattr(eng, "prefill_chunk", chunk)
        full = full_logprobs(eng, ids)
        want = full[torch.arange(299), torch.tensor(ids[1:])]
        monkeypatch.setattr(eng.model, "head_logits", lambda X: (rows.append(X.shape[0]), head(X))[1])
        got = eng.prompt_logprobs(ids, top=3)
        monkeypatch.setattr(eng.model, "head_logits", head)
        assert torch.equal(torch.tensor(got.logprobs[1:]), want)
        assert got.ranks[1:] == ((full[:-1] > want[:, None]).sum(1) + 1).tolist()
        assert [[t for t, _ in top] for top in got.top[1:]] == full[:-1].topk(3, dim=-1).indices.tolist()
    assert rows and max(rows) <= HEAD_ROWS + ops.SMALL_CHUNK and sum(rows) == 2 * 299


def test_prompt_logprobs_refuse_bad_prompts(eng):
    for bad, match in (([], "empty"), ([1, 5000], "outside the vocabulary"), ("", "empty")):
        with pytest.raises(PromptError, match=match):
            eng.prompt_logprobs(bad)
    with pytest.raises(ValueError, match="top"):
        eng.prompt_logprobs([1, 2, 3], top=-1)


def test_scheduler_scores_the_prompt_while_others_decode(eng):
    """A request with `prompt_logprobs` in a batch of decoding requests: its first chunk carries exactly
    `Engine.prompt_logprobs`'s numbers, its tokens are those of the request alone without them, and it starts from
    the first position where a plain request reuses a kept state. With max_tokens 0 it is scored and nothing is
    generated."""
    ids = prompt(7, 90)
    want = eng.prompt_logprobs(ids, top=2)
    plain = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=1)
    sched = eng.scheduler(max_batch=4, keep_states=2)
    warm = sched.submit(ids[:60], SamplingParams(max_tokens=2, ignore_eos=True))  # a state sharing 60 tokens
    sched.run_until_idle()
    assert list(warm)[-1].finish_reason == "length"
    others = [sched.submit(prompt(20 + i, 30), SamplingParams(max_tokens=12, ignore_eos=True)) for i in range(2)]
    scored = sched.submit(ids, SamplingParams(max_tokens=6, ignore_eos=True, logprobs=1, prompt_logprobs=2))
    only = sched.submit(ids, SamplingParams(max_tokens=0, prompt_logprobs=0))
    alone = sched.submit(ids, plain)
    sched.run_until_idle()
    chunks, only_chunks, alone_chunks = list(scored), list(only), list(alone)
    assert chunks[0].prompt_logprobs == want and all(c.prompt_logprobs is None for c in chunks[1:])
    assert chunks[-1].usage["cached_tokens"] == 0 and alone_chunks[-1].usage["cached_tokens"] > 0
    assert [(c.token, c.logprob) for c in chunks] == [(c.token, c.logprob) for c in solo(eng, ids, plain)]
    assert len(only_chunks) == 1 and only_chunks[0].finish_reason == "length" and only_chunks[0].token is None
    assert only_chunks[0].prompt_logprobs.logprobs == want.logprobs and only_chunks[0].prompt_logprobs.top[1] == []
    assert all(list(h)[-1].finish_reason == "length" for h in others)
    # Engine.stream asks the same of a one-request scheduler
    streamed = list(eng.stream(ids, SamplingParams(max_tokens=6, ignore_eos=True, logprobs=1, prompt_logprobs=2)))
    assert streamed[0].prompt_logprobs == want and [c.token for c in streamed] == [c.token for c in chunks]


def test_every_choice_of_a_prompt_carries_its_scores(eng):
    """Choices of one prompt (n > 1): the prompt is scored once and every choice's first chunk carries the scores,
    with max_tokens 0 too."""
    ids = prompt(8, 40)
    want = eng.prompt_logprobs(ids, top=1)
    sched = eng.scheduler(max_batch=4)
    for max_tokens in (3, 0):
        params = [SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=s, prompt_logprobs=1) for s in (1, 2)]
        handles = sched.submit_choices(ids, params)
        sched.run_until_idle()
        for h in handles:
            chunks = list(h)
            assert chunks[0].prompt_logprobs == want and len(chunks) == max(1, max_tokens)
