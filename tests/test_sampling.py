"""Verifiable sampling: the noise function against its specification's vectors, its distribution, the
built-in engine's seeded answers (independent of their batch, reproducible, different per seed) checked
exactly by the verifier at temperatures 0, 0.7 and 1 with and without a nucleus (`top_p`), a single
deviating token caught, and `seed` and `top_p` through the OpenAI API driven by the `openai` client."""

from __future__ import annotations

import asyncio
import math
import statistics
import threading
from collections import Counter

import pytest
import torch
from openai import BadRequestError, OpenAI
from transformers import LogitsProcessorList

from planetserve import sampling
from planetserve.chain.challenge import sign_response
from planetserve.chain.keys import KeySet
from planetserve.models import LoadedModel, load
from planetserve.node.api.engine_server import EngineServer
from planetserve.node.engine.base import GenerationRequest
from planetserve.node.engine.builtin import BuiltinEngine
from planetserve.registry.epochs import milli, to_seed
from planetserve.sampling import (
    SEED_LIMIT,
    VECTORS,
    GumbelProcessor,
    gumbel,
    gumbel_row,
    noised_logits,
    nucleus,
    position_key,
    sample,
    shortfalls,
)
from planetserve.verifier import Answer, Decoding, OnePassScorer, ReferenceModel

KEYS = [((0, 0), (2859646292, 3686749383)), ((42, 7), (3342335467, 1537393202))]
PROMPTS = ["What does json.dumps() do?", "Explain with in Python.", "What is the re module for?",
           "What is collections.OrderedDict?", "How do I read a file?", "What does str.split() do?"]


def test_the_noise_matches_the_specification_vectors():
    for (seed, position), words in KEYS:
        assert position_key(seed, position) == words
    for seed, position, token, value in VECTORS:
        assert gumbel(seed, position, token) == value
        assert gumbel_row(seed, position, token + 3)[token].item() == value


def test_the_noise_is_standard_gumbel_and_its_argmax_samples_the_softmax():
    row = gumbel_row(9, 3, 200_000)
    assert row.mean().item() == pytest.approx(0.5772, abs=0.01)  # Euler-Mascheroni
    assert row.std().item() == pytest.approx(math.pi / math.sqrt(6), abs=0.01)
    assert len(set(row.tolist())) == len(row)  # keyed by token id, a bijection: no two tokens share a draw
    logits, temperature = torch.tensor([0.0, 1.0, 2.0, -1.0, 0.5]), 0.7
    counts = Counter(sample(logits, temperature, seed, 0) for seed in range(20_000))
    expected = torch.softmax(logits / temperature, -1).tolist()
    for token, p in enumerate(expected):
        assert counts[token] / 20_000 == pytest.approx(p, abs=0.015)
    assert {sample(logits, 0.0, seed, 0) for seed in range(50)} == {2}  # greedy: no noise


def test_the_noise_refuses_what_the_specification_does_not_define():
    with pytest.raises(ValueError, match="seed must lie in"):
        gumbel(-1, 0, 0)
    with pytest.raises(ValueError, match="seed must lie in"):
        gumbel_row(SEED_LIMIT, 0, 4)
    with pytest.raises(ValueError, match="position must lie in"):
        gumbel(0, -1, 0)
    assert to_seed(-1) == SEED_LIMIT - 1 and to_seed(5) == 5


def test_a_shortfall_is_zero_for_the_honest_choice_and_the_gap_otherwise():
    logprobs = torch.log_softmax(torch.tensor([[0.0, 1.0, 3.0], [2.0, 0.0, 0.0]]), -1)
    greedy = shortfalls(logprobs, torch.tensor([2, 1]), 0.0, 0).tolist()
    assert greedy[0] == 0.0 and greedy[1] == pytest.approx(2.0)
    honest = [sample(logprobs[i], 1.0, 77, i) for i in range(2)]
    assert shortfalls(logprobs, torch.tensor(honest), 1.0, 77).tolist() == [0.0, 0.0]


def test_shortfalls_worked_through_in_chunks_equal_one_pass(monkeypatch):
    logprobs = torch.log_softmax(torch.randn(37, 50, generator=torch.Generator().manual_seed(3)), -1)
    tokens = torch.randint(50, (37,), generator=torch.Generator().manual_seed(4))
    whole = shortfalls(logprobs, tokens, 0.7, 11)
    monkeypatch.setattr(sampling, "CHUNK_ELEMENTS", 120)  # two positions at a time
    assert torch.equal(shortfalls(logprobs, tokens, 0.7, 11), whole)
    assert torch.equal(shortfalls(logprobs.double(), tokens, 0.7, 11), whole)
    assert shortfalls(logprobs[:0], tokens[:0], 0.7, 11).shape == (0,)


@pytest.fixture(scope="module")
def gt(quick_family) -> LoadedModel:
    return load("gt", quick_family)


@pytest.fixture(scope="module")
def tiny(quick_family) -> LoadedModel:
    return load("tiny", quick_family)


def answers(loaded: LoadedModel, requests: list[GenerationRequest], max_batch: int = 8) -> list[list[int]]:
    """The built-in engine's answers, all submitted at once (batched up to `max_batch`), to their full
    length (no stop token: the quick family often ends a greedy answer at once)."""
    async def run() -> list[list[int]]:
        engine = BuiltinEngine(loaded.model, "gt", max_batch=max_batch)
        try:
            async def one(request: GenerationRequest) -> list[int]:
                return [t async for chunk in engine.generate(request) for t in chunk.token_ids]
            return list(await asyncio.gather(*(one(r) for r in requests)))
        finally:
            await engine.close()
    return asyncio.run(run())


def requests_at(loaded: LoadedModel, temperature: float, seeds: list[int], top_p: float = 1.0
                ) -> list[GenerationRequest]:
    return [GenerationRequest(tuple(loaded.tokenizer(p)["input_ids"]), 24, temperature, seed, top_p=top_p)
            for p, seed in zip(PROMPTS, seeds, strict=True)]


@pytest.mark.parametrize(("temperature", "top_p"), [(0.0, 1.0), (0.7, 1.0), (1.0, 1.0), (0.7, 0.9), (1.0, 0.5)])
def test_seeded_answers_do_not_depend_on_their_batch_and_verify_exactly(gt, tiny, temperature, top_p):
    seeds = [11, 22, 33, 44, 55, 66]
    batched = answers(gt, requests_at(gt, temperature, seeds, top_p))
    alone = [answers(gt, [r], max_batch=1)[0] for r in requests_at(gt, temperature, seeds, top_p)]
    assert batched == alone
    keys, reference = KeySet.generate(), ReferenceModel.from_loaded(gt)

    def verdicts(tokens: list[list[int]], seeds: list[int], signed_top_p: float = top_p):
        signed = [sign_response(keys, p, ids, gt.tokenizer.decode(ids, skip_special_tokens=True),
                                reference.model_id, 0, "h:1", milli(temperature), seed, milli(signed_top_p))
                  for p, ids, seed in zip(PROMPTS, tokens, seeds, strict=True)]
        return reference.verify([Answer(s, p, keys.public) for s, p in zip(signed, PROMPTS, strict=True)])

    honest = verdicts(batched, seeds)
    assert all(v.ok and v.calibrated == 1.0 and v.deviations == 0 for v in honest)
    # a weaker model under the very same seeds deviates
    weaker = verdicts(answers(tiny, requests_at(tiny, temperature, seeds, top_p)), seeds)
    assert sum(v.deviations for v in weaker) >= len(PROMPTS)
    assert statistics.median(v.calibrated for v in weaker) < 0.5
    if temperature > 0:
        # the seed decides: another seed gives other answers, which do not pass under the first seeds
        other = answers(gt, requests_at(gt, temperature, [s + 1 for s in seeds], top_p))
        assert other != batched
        assert sum(v.deviations for v in verdicts(other, seeds)) > 0
    if temperature > 0 and top_p < 1:
        # the nucleus decides too: the whole distribution's answers do not pass as the nucleus's
        whole = answers(gt, requests_at(gt, temperature, seeds))
        assert whole != batched
        assert sum(v.deviations for v in verdicts(whole, seeds)) > 0
        assert sum(v.deviations for v in verdicts(batched, seeds, signed_top_p=1.0)) > 0


def test_a_single_deviating_token_is_caught(gt):
    prompt_ids = gt.tokenizer(PROMPTS[0])["input_ids"]
    seed, temperature = 1234, 0.7
    honest = answers(gt, [GenerationRequest(tuple(prompt_ids), 24, temperature, seed)])[0]
    scorer = OnePassScorer(gt.model)
    assert max(scorer.score_choices([(prompt_ids, honest)], [Decoding(temperature, seed)])[0].shortfalls) < 1e-4
    # swap token 5 for the runner-up under the same noise: one deviation, costing its gap
    with torch.inference_mode():
        logits = gt.model(input_ids=torch.tensor([prompt_ids + honest[:5]])).logits[0, -1]
    noised = logits.double().log_softmax(-1) + temperature * gumbel_row(seed, 5, logits.shape[-1])
    runner_up = int(noised.topk(2).indices[1])
    gap = (noised.max() - noised[runner_up]).item()
    forged = honest[:5] + [runner_up] + honest[6:]
    short = scorer.score_choices([(prompt_ids, forged)], [Decoding(temperature, seed)])[0].shortfalls
    assert short[5] == pytest.approx(gap, abs=1e-4) and all(s < 1e-4 for s in short[:5])
    keys, reference = KeySet.generate(), ReferenceModel.from_loaded(gt)
    text = gt.tokenizer.decode(forged, skip_special_tokens=True)
    signed = sign_response(keys, PROMPTS[0], forged, text, reference.model_id, 0, "h:1", 700, seed)
    verdict = reference.verify_one(signed, PROMPTS[0], keys.public)
    assert verdict.deviations >= 1 and verdict.calibrated < 1.0


def test_the_nucleus_keeps_the_likeliest_tokens_until_their_mass_reaches_top_p():
    probs = torch.tensor([0.05, 0.3, 0.15, 0.5], dtype=torch.float64)
    scaled = probs.log()
    assert nucleus(scaled, 0.79).tolist() == [False, True, False, True]  # 0.5, then 0.3 (0.5 < 0.79)
    assert nucleus(scaled, 0.81).tolist() == [False, True, True, True]  # 0.8 before the third < 0.81
    assert nucleus(scaled, 0.0).tolist() == [False, False, False, True]  # the likeliest, always
    assert nucleus(scaled, 1.0).all()
    # a tie is broken by the lower token id, and top_p may differ per row
    tied = torch.tensor([[0.4, 0.4, 0.2], [0.4, 0.4, 0.2]], dtype=torch.float64).log()
    rows = nucleus(tied, torch.tensor([[0.3], [1.0]], dtype=torch.float64))
    assert rows.tolist() == [[True, False, False], [True, True, True]]


def test_sampling_under_a_nucleus_stays_in_it_and_top_p_zero_is_greedy():
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(64, 300, generator=generator) * 3
    for position, row in enumerate(logits):
        kept = nucleus(row.double() / 0.8, 0.9)
        token = sample(row, 0.8, 77, position, 0.9)
        assert kept[token]
        assert sample(row, 0.8, 77, position, 0.0) == int(row.argmax())
        assert sample(row, 0.8, 77, position, 1.0) == int((row.double() / 0.8 + gumbel_row(77, position, 300)).argmax())
    # a batch with a nucleus per row gives each row what it gets alone
    top_ps = [0.9, 1.0, 0.5, 0.0] * 16
    batched = noised_logits(logits, [0.8] * 64, [77] * 64, list(range(64)), top_ps).argmax(-1).tolist()
    assert batched == [sample(row, 0.8, 77, i, p) for i, (row, p) in enumerate(zip(logits, top_ps, strict=True))]
    for bad in (-0.1, 1.5, math.nan):
        with pytest.raises(ValueError, match="top_p must lie in"):
            sample(logits[0], 0.8, 77, 0, bad)


@pytest.mark.parametrize("temperature", [0.3, 0.7, 1.0])
def test_an_engine_whose_log_probabilities_differ_within_the_margin_is_never_short_under_a_nucleus(temperature):
    """The verifier cannot know an honest engine's nucleus to the last ulp: every engine whose
    log-probabilities lie within margin / 2 of the reference's answers within the margin, while tokens
    from outside the nucleus, or a nucleus ignored, fall short by infinity."""
    generator = torch.Generator().manual_seed(11)
    margin, positions, vocab = 0.05, 400, 200
    reference = (torch.randn(positions, vocab, generator=generator, dtype=torch.float64) * 2).log_softmax(-1)
    engine = reference + (torch.rand(positions, vocab, generator=generator, dtype=torch.float64) - 0.5) * margin
    for top_p in (0.0, 0.5, 0.9):
        honest = torch.tensor([sample(row, temperature, 3, i, top_p) for i, row in enumerate(engine)])
        short = shortfalls(reference, honest, temperature, 3, top_p, margin)
        assert short.max() <= margin + 1e-9, (top_p, short.max())
        if top_p <= 0.5:  # a narrow nucleus, which the whole distribution's samples often leave
            whole = torch.tensor([sample(row, temperature, 3, i) for i, row in enumerate(reference)])
            caught = shortfalls(reference, whole, temperature, 3, top_p, margin)
            assert (caught > margin).sum() >= 10 and math.isinf(caught.max())
        outside = (~nucleus(reference / temperature, top_p)).double().argmax(-1)  # some token outside each
        assert bool((shortfalls(reference, outside, temperature, 3, top_p, 0.0) == math.inf).all())


@pytest.fixture(scope="module")
def served(gt):
    """gt behind the OpenAI-compatible engine server on its own event loop thread; yields its URL."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    engine = BuiltinEngine(gt.model, "gt", gt.stop_token_ids)
    server = EngineServer(engine, gt.tokenizer, model_name="gt")
    url = asyncio.run_coroutine_threadsafe(server.start(), loop).result(30)
    yield url
    asyncio.run_coroutine_threadsafe(server.close(), loop).result(30)
    asyncio.run_coroutine_threadsafe(engine.close(), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


def test_the_openai_seed_reproduces_a_sampled_answer_that_the_verifier_checks(served, gt):
    client = OpenAI(base_url=f"{served}/v1", api_key="none", max_retries=0)

    def ask(seed: int) -> list[int]:
        answer = client.completions.create(model="gt", prompt=PROMPTS[1], max_tokens=16, temperature=1.0,
                                           seed=seed, extra_body={"return_token_ids": True})
        return answer.choices[0].model_extra["token_ids"]

    first, again, other = ask(-5), ask(-5), ask(6)
    assert first == again and first != other
    prompt_ids = gt.tokenizer(PROMPTS[1])["input_ids"]
    scores = OnePassScorer(gt.model).score_choices([(prompt_ids, first)], [Decoding(1.0, to_seed(-5))])[0]
    assert max(scores.shortfalls) < 1e-4


def test_the_openai_top_p_is_sampled_signed_and_checked_and_a_bad_one_refused(served, gt):
    client = OpenAI(base_url=f"{served}/v1", api_key="none", max_retries=0)
    answer = client.completions.create(model="gt", prompt=PROMPTS[3], max_tokens=16, temperature=1.0, seed=8,
                                       top_p=0.9, extra_body={"return_token_ids": True})
    tokens = answer.choices[0].model_extra["token_ids"]
    alone = answers(gt, [GenerationRequest(tuple(gt.tokenizer(PROMPTS[3])["input_ids"]), 16, 1.0, 8, top_p=0.9)])
    assert tokens == alone[0][:len(tokens)]
    prompt_ids = gt.tokenizer(PROMPTS[3])["input_ids"]
    scores = OnePassScorer(gt.model).score_choices([(prompt_ids, tokens)], [Decoding(1.0, 8, 0.9, 0.05)])[0]
    assert max(scores.shortfalls) <= 0.05
    chat = client.chat.completions.create(model="gt", messages=[{"role": "user", "content": PROMPTS[0]}],
                                          max_tokens=4, temperature=0.7, top_p=0.5, seed=1)
    assert chat.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(BadRequestError, match="`top_p` must be between 0 and 1") as refused:
        client.completions.create(model="gt", prompt=PROMPTS[0], max_tokens=4, top_p=1.5)
    assert refused.value.body["param"] == "top_p"
    with pytest.raises(BadRequestError, match="`top_k` is not supported by this server"):
        client.completions.create(model="gt", prompt=PROMPTS[0], max_tokens=4, extra_body={"top_k": 40})


def test_transformers_generate_with_the_noise_processor_answers_as_the_engine_does(gt):
    """Two honest paths (the serving engine, and transformers' generate for answers made outside one)
    emit the same tokens under the same seed."""
    prompt_ids = gt.tokenizer(PROMPTS[2])["input_ids"]
    served = answers(gt, [GenerationRequest(tuple(prompt_ids), 16, 0.7, 99)])[0]
    out = gt.model.generate(torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=16,
                            logits_processor=LogitsProcessorList([GumbelProcessor(0.7, 99, len(prompt_ids))]),
                            pad_token_id=gt.tokenizer.pad_token_id, eos_token_id=[])
    assert out[0, len(prompt_ids):].tolist() == served
    nucleus_served = answers(gt, [GenerationRequest(tuple(prompt_ids), 16, 0.7, 99, top_p=0.8)])[0]
    out = gt.model.generate(torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=16,
                            logits_processor=LogitsProcessorList([GumbelProcessor(0.7, 99, len(prompt_ids), 0.8)]),
                            pad_token_id=gt.tokenizer.pad_token_id, eos_token_id=[])
    assert out[0, len(prompt_ids):].tolist() == nucleus_served
    with pytest.raises(ValueError, match="greedy decoding needs no noise"):
        GumbelProcessor(0.0, 1, 3)
