"""Verifier scoring on the quick model family: the one-pass engine against the paper's Algorithm 3,
batching, the credibilities, every rejection reason, and the ledger's ppm."""

from __future__ import annotations

import dataclasses
import math
import random
import statistics
from pathlib import Path

import pytest
import torch

from planetserve.chain.challenge import sign_response
from planetserve.chain.keys import KeySet
from planetserve.models import LoadedModel, load
from planetserve.node.behaviours import clickbait
from planetserve.registry.params import PPM
from planetserve.sampling import sample
from planetserve.verifier import (
    Algorithm3Scorer,
    Answer,
    Decoding,
    OnePassScorer,
    ReferenceModel,
    Rejection,
    Verdict,
    choice_credibility,
    credibility,
    deviations,
    to_ppm,
)

QUESTIONS = ["What does json.dumps() do?", "What is the os.path module for?", "What is collections.OrderedDict?",
             "What does str.split() do?", "Explain with in Python.", "What is the re module for?"]
GT = "planetserve/gt"


@pytest.fixture(scope="module")
def gt(quick_family: Path) -> LoadedModel:
    return load("gt", quick_family)


@pytest.fixture(scope="module")
def tiny(quick_family: Path) -> LoadedModel:
    return load("tiny", quick_family)


@pytest.fixture(scope="module")
def reference(gt: LoadedModel) -> ReferenceModel:
    return ReferenceModel.from_loaded(gt)


@pytest.fixture(scope="module")
def keys() -> KeySet:
    return KeySet.generate()


def chat(loaded: LoadedModel, question: str) -> str:
    return loaded.tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                                add_generation_prompt=True)


def generate(loaded: LoadedModel, reference: ReferenceModel, prompt: str, tokens: int = 24,
             temperature: float = 0.0, seed: int = 0) -> list[int]:
    """The model's answer to `prompt` as an honest engine decodes it (planetserve.sampling: greedy at
    temperature 0, else the seed's Gumbel-max), one full forward pass a token, its stop token kept."""
    ids, answer = reference.prompt_ids(prompt), []
    with torch.inference_mode():
        for position in range(tokens):
            logits = loaded.model(input_ids=torch.tensor([ids + answer])).logits[0, -1]
            answer.append(sample(logits, temperature, seed, position))
            if answer[-1] in loaded.stop_token_ids:
                break
    return answer


def signed(keys: KeySet, loaded: LoadedModel, prompt: str, token_ids: list[int], model_id: str = GT,
           text: str | None = None, temperature: int = 0, seed: int = 0) -> Answer:
    """The answer as a node signs it, asked for `temperature` thousandths (greedy by default) and `seed`."""
    text = loaded.tokenizer.decode(token_ids, skip_special_tokens=True) if text is None else text
    return Answer(sign_response(keys, prompt, token_ids, text, model_id, 1_700_000_000, "127.0.0.1:7000",
                                temperature, seed), prompt, keys.public)


def random_batch(seed: int, vocab: int, count: int = 7) -> list[tuple[list[int], list[int]]]:
    rng = random.Random(seed)
    batch = [([0] + [rng.randrange(5, vocab) for _ in range(rng.randrange(0, 30))],
              [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]) for _ in range(count)]
    batch.append(([0, 7, 9], []))
    return batch


def close(a: list[float] | tuple[float, ...], b: list[float] | tuple[float, ...], tolerance: float) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= tolerance for x, y in zip(a, b, strict=True))


# -- engines ---------------------------------------------------------------------------------------


def test_one_pass_agrees_with_algorithm3(gt, reference):
    batch = random_batch(1, reference.vocab_size)
    batch.append((reference.prompt_ids(chat(gt, QUESTIONS[0])), generate(gt, reference, chat(gt, QUESTIONS[0]))))
    decodings = [Decoding(0.7 * (i % 3), i) for i in range(len(batch))]
    one = OnePassScorer(gt.model).score_choices(batch, decodings)
    alg3 = Algorithm3Scorer(gt.model).score_choices(batch, decodings)
    for a, b, (_, response) in zip(one, alg3, batch, strict=True):
        assert len(a.logprobs) == len(response)
        assert close(a.logprobs, b.logprobs, 1e-4)
        assert close(a.shortfalls, b.shortfalls, 1e-4)
    for plain, full in zip(OnePassScorer(gt.model).score(batch), one, strict=True):
        assert close(plain, full.logprobs, 1e-6)


def test_batched_equals_unbatched_in_order(gt, reference):
    batch = random_batch(2, reference.vocab_size, count=12)
    decodings = [Decoding(1.0 if i % 2 else 0.0, i) for i in range(len(batch))]
    alone = [OnePassScorer(gt.model).score_choices([item], [d])[0] for item, d in zip(batch, decodings, strict=True)]
    whole = OnePassScorer(gt.model).score_choices(batch, decodings)
    split = OnePassScorer(gt.model, max_batch_tokens=64, max_scored_tokens=48)
    assert len(split._groups(split._checked(batch))) > 2
    for scores in (whole, split.score_choices(batch, decodings)):
        for a, b in zip(scores, alone, strict=True):
            assert close(a.logprobs, b.logprobs, 1e-5)
            assert close(a.shortfalls, b.shortfalls, 1e-5)
    with pytest.raises(ValueError, match="2 decodings for 3 items"):
        OnePassScorer(gt.model).score_choices(batch[:3], decodings[:2])


def test_first_token_is_scored_on_the_prompt_alone(gt, reference):
    """Nothing (no BOS) is inserted between prompt and response, and every response token is scored."""
    prompt, response = reference.prompt_ids(chat(gt, QUESTIONS[1])), [17, 4, 1]
    with torch.inference_mode():
        direct = gt.model(input_ids=torch.tensor([prompt])).logits[0, -1].log_softmax(-1)
    scores = OnePassScorer(gt.model).score([(prompt, response)])[0]
    assert len(scores) == len(response)
    assert scores[0] == pytest.approx(direct[response[0]].item(), abs=1e-5)


def test_scorer_refuses_what_the_model_cannot_read(gt):
    scorer = OnePassScorer(gt.model)
    with pytest.raises(ValueError, match="prompt is empty"):
        scorer.score([([], [5])])
    with pytest.raises(ValueError, match="token ids"):
        scorer.score([([0], [scorer.vocab_size])])


# -- credibility -----------------------------------------------------------------------------------


def test_gt_answers_are_more_credible_under_gt_than_tiny_answers(gt, tiny, reference, keys):
    prompts = [chat(gt, q) for q in QUESTIONS]
    greedy = reference.verify([signed(keys, gt, p, generate(gt, reference, p)) for p in prompts])
    gt_sampled = reference.verify([signed(keys, gt, p, generate(gt, reference, p, temperature=1.0, seed=i),
                                          temperature=1000, seed=i) for i, p in enumerate(prompts)])
    tiny_sampled = reference.verify([signed(keys, tiny, p, generate(tiny, reference, p, temperature=1.0, seed=i),
                                            temperature=1000, seed=i) for i, p in enumerate(prompts)])
    assert all(v.ok for v in greedy + gt_sampled + tiny_sampled)

    def mean(verdicts: list[Verdict], field: str) -> float:
        return sum(getattr(v, field) for v in verdicts) / len(verdicts)

    assert mean(greedy, "credibility") > mean(tiny_sampled, "credibility")
    assert mean(gt_sampled, "credibility") > mean(tiny_sampled, "credibility")
    # Greedy or sampled under its seed, gt makes the honest choice at every step; tiny, under the same
    # seeds, does not.
    assert all(v.calibrated == 1.0 and v.deviations == 0 for v in greedy + gt_sampled)
    assert mean(tiny_sampled, "calibrated") < 0.05 and all(v.deviations > 0 for v in tiny_sampled)
    # 1/PPL drops with the temperature; the calibrated credibility does not.
    assert mean(gt_sampled, "credibility") < mean(greedy, "credibility")


def test_a_greedy_request_holds_the_node_to_the_reference_choices(gt, tiny, reference, keys):
    """Asked for temperature 0, gt's answers score 1; tiny's, gt's answer to a reworded prompt and a
    sampled answer signed as greedy fall far below, though the sampled-answer rule would pass them.
    (Completion prompts: the quick family's greedy chat answers are all line breaks, whoever answers.)"""
    prompts = QUESTIONS
    greedy = [generate(gt, reference, p) for p in prompts]
    honest = reference.verify([signed(keys, gt, p, ids) for p, ids in zip(prompts, greedy, strict=True)])
    weaker = reference.verify([signed(keys, tiny, p, generate(tiny, reference, p)) for p in prompts])
    reworded = reference.verify([signed(keys, gt, p, generate(gt, reference, clickbait(p))) for p in prompts])
    hot = [generate(gt, reference, p, temperature=1.0, seed=i) for i, p in enumerate(prompts)]
    claimed_greedy = reference.verify([signed(keys, gt, p, ids) for p, ids in zip(prompts, hot, strict=True)])
    as_sampled = reference.verify([signed(keys, gt, p, ids, temperature=1000, seed=i)
                                   for i, (p, ids) in enumerate(zip(prompts, hot, strict=True))])
    assert [v.calibrated for v in honest] == [1.0] * len(prompts)
    assert statistics.median(v.calibrated for v in weaker) < 0.01
    assert statistics.median(v.calibrated for v in reworded) < 0.01
    # a sampled answer passes as greedy exactly where it is the greedy answer
    differs = [h != g for h, g in zip(hot, greedy, strict=True)]
    assert any(differs)
    assert all(v.calibrated < 0.01 for v, d in zip(claimed_greedy, differs, strict=True) if d)
    assert all(v.calibrated == 1.0 for v, d in zip(claimed_greedy, differs, strict=True) if not d)
    assert all(v.calibrated == 1.0 for v in as_sampled)
    # the paper's 1/PPL does not depend on the temperature the node was asked for
    assert [v.credibility for v in claimed_greedy] == pytest.approx([v.credibility for v in as_sampled])


def test_verdicts_keep_order_and_ppm(gt, reference, keys):
    prompt = chat(gt, QUESTIONS[2])
    good = signed(keys, gt, prompt, generate(gt, reference, prompt))
    bad = signed(keys, gt, prompt, [])
    verdicts = reference.verify([good, bad, good])
    assert [v.ok for v in verdicts] == [True, False, True]
    alone = reference.verify_one(good.response, prompt, keys.public)
    for v in (verdicts[0], verdicts[2]):
        assert v.credibility == pytest.approx(alone.credibility, rel=1e-5)
        assert v.calibrated == pytest.approx(alone.calibrated, rel=1e-5)
    v = verdicts[0]
    assert v.tokens == len(good.response.token_ids)
    assert 0 < v.credibility <= 1 and 0 < v.calibrated <= 1
    assert v.credibility_ppm == to_ppm(v.credibility) and v.calibrated_ppm == to_ppm(v.calibrated)
    paper_only = ReferenceModel.from_loaded(gt, calibrated=False).verify_one(good.response, prompt)
    assert paper_only.calibrated is None and paper_only.calibrated_ppm is None
    assert paper_only.credibility == pytest.approx(v.credibility, rel=1e-6)
    assert verdicts[1].credibility is None and verdicts[1].credibility_ppm is None


def test_prompt_ids_neither_miss_nor_double_bos(gt, reference):
    bos = gt.tokenizer.bos_token_id
    chat_ids = reference.prompt_ids(chat(gt, QUESTIONS[0]))
    plain_ids = reference.prompt_ids("What does json.dumps() do?")
    assert chat_ids[0] == bos and chat_ids[1] != bos
    assert plain_ids[0] == bos and plain_ids[1] != bos


# -- rejections ------------------------------------------------------------------------------------


def _tamper_text(a: Answer, gt: LoadedModel, keys: KeySet) -> Answer:
    return dataclasses.replace(a, response=dataclasses.replace(a.response, text=a.response.text + "!"))


def _tamper_ids(a: Answer, gt: LoadedModel, keys: KeySet) -> Answer:
    ids = (*a.response.token_ids[:-1], (a.response.token_ids[-1] + 1) % 50 + 5)
    return dataclasses.replace(a, response=dataclasses.replace(a.response, token_ids=ids))


def _tamper_signature(a: Answer, gt: LoadedModel, keys: KeySet) -> Answer:
    sig = bytes([a.response.signature[0] ^ 1]) + a.response.signature[1:]
    return dataclasses.replace(a, response=dataclasses.replace(a.response, signature=sig))


def _tamper_model(a: Answer, gt: LoadedModel, keys: KeySet) -> Answer:
    return dataclasses.replace(a, response=dataclasses.replace(a.response, model_id="planetserve/tiny"))


def _text_mismatch(a: Answer, gt: LoadedModel, keys: KeySet) -> Answer:
    return signed(keys, gt, a.prompt, list(a.response.token_ids), text=a.response.text + " extra")


def _empty(a: Answer, gt: LoadedModel, keys: KeySet) -> Answer:
    return signed(keys, gt, a.prompt, [], text="")


def _wrong_model(a: Answer, gt: LoadedModel, keys: KeySet) -> Answer:
    return signed(keys, gt, a.prompt, list(a.response.token_ids), model_id="planetserve/tiny")


def _other_prompt(a: Answer, gt: LoadedModel, keys: KeySet) -> Answer:
    other = signed(keys, gt, chat(gt, QUESTIONS[4]), list(a.response.token_ids))
    return dataclasses.replace(other, prompt=a.prompt)


def _other_node(a: Answer, gt: LoadedModel, keys: KeySet) -> Answer:
    return dataclasses.replace(signed(KeySet.generate(), gt, a.prompt, list(a.response.token_ids)),
                               node=keys.public)


def _out_of_vocab(a: Answer, gt: LoadedModel, keys: KeySet) -> Answer:
    return signed(keys, gt, a.prompt, [*a.response.token_ids, 1 << 20], text=a.response.text)


def _too_long(a: Answer, gt: LoadedModel, keys: KeySet) -> Answer:
    return signed(keys, gt, a.prompt, [40] * gt.max_model_len)


@pytest.mark.parametrize(("tamper", "rejection"), [
    (_tamper_text, Rejection.BAD_SIGNATURE),
    (_tamper_ids, Rejection.BAD_SIGNATURE),
    (_tamper_signature, Rejection.BAD_SIGNATURE),
    (_tamper_model, Rejection.BAD_SIGNATURE),
    (_text_mismatch, Rejection.TOKENIZATION_MISMATCH),
    (_empty, Rejection.EMPTY_RESPONSE),
    (_wrong_model, Rejection.WRONG_MODEL),
    (_other_prompt, Rejection.WRONG_PROMPT),
    (_other_node, Rejection.WRONG_NODE),
    (_out_of_vocab, Rejection.INVALID_TOKEN_ID),
    (_too_long, Rejection.TOO_LONG),
])
def test_each_rejection_triggers_on_its_bad_input(gt, reference, keys, tamper, rejection):
    prompt = chat(gt, QUESTIONS[3])
    honest = signed(keys, gt, prompt, generate(gt, reference, prompt))
    assert reference.verify([honest])[0].ok
    verdict = reference.verify([tamper(honest, gt, keys)])[0]
    assert verdict.rejection is rejection and not verdict.ok
    assert verdict.detail
    assert verdict.credibility is None and verdict.calibrated is None


def test_only_faults_the_node_signed_are_its_own():
    leaders = {Rejection.WRONG_NODE, Rejection.BAD_SIGNATURE, Rejection.WRONG_PROMPT}
    for rejection in Rejection:
        assert rejection.node_fault == (rejection not in leaders)


# -- numbers ---------------------------------------------------------------------------------------


def test_to_ppm_bounds_and_rounding():
    assert to_ppm(0.0) == 0 and to_ppm(1.0) == PPM
    assert to_ppm(-0.5) == 0 and to_ppm(1.0000001) == PPM and to_ppm(math.inf) == PPM and to_ppm(-math.inf) == 0
    assert to_ppm(0.5) == 500_000
    assert to_ppm(1 / 3) == 333_333 and to_ppm(2 / 3) == 666_667
    assert to_ppm(0.0000004) == 0 and to_ppm(0.0000006) == 1
    assert to_ppm(0.1234565) == 123_457 and to_ppm(0.9999996) == PPM
    assert all(isinstance(to_ppm(x / 7), int) for x in range(8))
    with pytest.raises(ValueError, match="NaN"):
        to_ppm(math.nan)


def test_credibility_formulas():
    assert credibility([math.log(0.5)] * 4) == pytest.approx(0.5)
    assert credibility([math.log(0.25), math.log(1.0)]) == pytest.approx(0.5)
    # each token short of the honest choice by more than the tolerance costs the excess, summed
    assert choice_credibility([0.0, 0.0]) == 1.0 and deviations([0.0, 0.0]) == 0
    assert choice_credibility([0.03, 0.0]) == 1.0 and deviations([0.03, 0.0]) == 0
    assert choice_credibility([0.55, 1.05]) == pytest.approx(math.exp(-1.5)) and deviations([0.55, 1.05]) == 2
    assert choice_credibility([0.5], tolerance=0.0) == pytest.approx(math.exp(-0.5))
    assert choice_credibility([math.inf]) == 0.0
    for fn, args, message in ((credibility, ([],), "undefined for an empty response"),
                              (choice_credibility, ([],), "empty response has no choices")):
        with pytest.raises(ValueError, match=message):
            fn(*args)
