"""Detecting dishonest model nodes (the paper's section 4.3, figures 10 and 11) on the project's model family.

Every variant answers the same natural challenge prompts (the question part of `planetserve.workloads`
requests, as a one-message chat) under each of the workload's decodings, at most 64 new tokens: greedily,
sampling at temperature 0.7 ("warm") and at temperature 1 ("sampled"), each of the two over the whole
vocabulary or over the top_p 0.9 nucleus ("warm-p0.9", "sampled-p0.9"). Sampling is the protocol's
(`planetserve.sampling`): prompt i is asked with seed + i, whatever the variant, and the answer is signed
with it, as every request carries a seed the requester chose.

- gt: the honest node (transformers' generate, one prompt at a time); gt-engine: the honest node on the
  built-in serving engine, prompts batched eight at a time on one thread (another engine, batch shape
  and thread count than the verifier's, so its answers measure the honest rate of deviation across
  engines);
- small, tiny: weaker models claiming gt; gt-int8, gt-int4: quantised gt;
- gt_cb: gt answering a clickbait rewrite of the prompt, scored against the original prompt;
- gt_ic: gt's answer with a long off-topic passage (fiction, documentary, pop psychology, advert) injected
  after it, before the stop token.

- small-nongreedy (mix only): gt on greedy requests, small on sampled ones (a node that cheats only where
  it once could not be checked).

The verifier's reference model is gt; every answer is signed with the temperature, seed and top_p it was
asked for and checked by `ReferenceModel.verify`, which gives both credibilities: the paper's 1/PPL and the
calibrated one (every token against the honest choice under the signed decoding, `choice_credibility`),
with the count of tokens beyond the tolerance. Per variant and decoding: the
credibility distribution and the AUC against honest gt (Mann-Whitney: the chance that a random honest
answer scores above a random answer of the variant, 0.5 = indistinguishable). Reputation: 35 epochs of
the ledger's integer rule (`registry.reputation.update`, `Params` defaults) at gamma = 1, 1/3 and 1/5;
each epoch a node answers `--challenges` prompts, and C(T) is as the ledger takes it: the product of
their credibilities in ppm (`finalization.product`), 0 while the evidence across epochs flags the node
(`registry.evidence`, over the answers' checked and deviating tokens; the calibrated rule only). A node
either answers from one decoding's pool, or ("mix", what a live network sees) takes each challenge's
decoding from the workload's weights (`workloads.TEMPERATURES` and `workloads.TOP_PS`) and the answer
from that decoding's pool.
The paper's targets: every dishonest variant untrusted (< 0.4) within 5 epochs at gamma = 1/5, no honest
node ever untrusted; the false-flag rate is the share of seeds in which an honest node ever is.

    .venv/bin/python bench/detection.py [--quick] [--data-dir DIR] [--prompts 50] [--seeds 200]
        [--challenges 3] [--figures docs/figures]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from transformers import LogitsProcessorList

from planetserve.chain.challenge import sign_response
from planetserve.chain.keys import KeySet
from planetserve.models import LoadedModel, load
from planetserve.node.behaviours import clickbait
from planetserve.node.engine.base import GenerationRequest
from planetserve.node.engine.builtin import BuiltinEngine
from planetserve.registry.epochs import milli
from planetserve.registry.evidence import EvidenceRule, accumulate, flagged
from planetserve.registry.finalization import product
from planetserve.registry.params import PPM, Params
from planetserve.registry.reputation import ReputationRule, is_trusted, update
from planetserve.sampling import GumbelProcessor
from planetserve.verifier import Answer, Decoding, ReferenceModel, to_ppm
from planetserve.workloads import TEMPERATURES, TOP_PS, detokenize, generate

QUICK_DATA = "/tmp/ps-quick-models"
HONEST = "gt"
MODELS = ("gt", "small", "tiny", "gt-int8", "gt-int4")
ENGINE = "gt-engine"
NONGREEDY = "small-nongreedy"
VARIANTS = (MODELS[0], ENGINE, *MODELS[1:], "gt_cb", "gt_ic")
DECODINGS = ("greedy", "warm", "warm-p0.9", "sampled", "sampled-p0.9")
SAMPLING = {"greedy": (0.0, 1.0), "warm": (0.7, 1.0), "warm-p0.9": (0.7, 0.9), "sampled": (1.0, 1.0),
            "sampled-p0.9": (1.0, 0.9)}
"""The (temperature, top_p) each decoding answers at and signs: the workload's own (`workloads.TEMPERATURES`,
`workloads.TOP_PS`)."""
MIX = "mix"
"""The node that answers each challenge in a decoding drawn with the workload's weights."""
MIX_WEIGHTS = {d: TEMPERATURES[t] * (sum(TOP_PS.values()) if t == 0 else TOP_PS[p])
               for d, (t, p) in SAMPLING.items()}
"""Temperature and top_p are drawn independently; a greedy answer is the same under every top_p."""
DEFINITIONS = ("1/PPL", "calibrated")
GAMMAS = {"1": PPM, "1/3": PPM // 3, "1/5": PPM // 5}
EPOCHS = 35
DETECT_WITHIN = 5
MAX_NEW_TOKENS = 64
ENGINE_BATCH = 8
QUESTION_SCALE = 0.02
"""Workload lengths scaled so far down that a request's suffix is its question alone."""

CONTINUATIONS = (
    "Once upon a time, in a kingdom built on clouds, a young dragon named Ember discovered that her "
    "fire could paint the sky. Every evening she flew above the sleeping villages and drew rivers of "
    "gold and violet across the horizon, until the old king summoned her to the tower and asked her to "
    "paint a sunrise that would never fade.",
    "The Serengeti stretches across nearly thirty thousand square kilometres of grassland. Each year, "
    "more than a million wildebeest follow the rains in a great circle, crossing rivers where crocodiles "
    "wait in the shallows. Researchers have tracked these herds for decades, recording how the timing of "
    "the migration shifts with the changing seasons.",
    "Psychologists say the secret to happiness is simpler than you think. People who write down three "
    "good things every night report feeling calmer within a week. Your brain is wired to notice threats, "
    "so gratitude is a muscle you have to train, and the more you practise it, the stronger it becomes.",
    "Tired of slow results? Try TurboBoost Pro today and feel the difference in just seven days! Thousands "
    "of happy customers already trust our award-winning formula. Order now and get a second bottle free, "
    "with fast shipping to your door and a full money-back guarantee!",
)


def challenge_prompts(count: int, seed: int = 0) -> list[str]:
    """`count` distinct user questions as the workloads generate them (no two nodes share a prompt)."""
    questions: list[str] = []
    batch = count
    while len(questions) < count:
        requests = generate("mixed", rate=1.0, count=batch, seed=seed, scale=QUESTION_SCALE)
        questions = list(dict.fromkeys(detokenize(r.suffix_ids) for r in requests))[:count]
        batch *= 2
    return questions


def inject(answer: Sequence[int], continuation: Sequence[int], stop_ids: Sequence[int]) -> list[int]:
    """The answer with `continuation` inserted before its final stop token (appended if there is none),
    so the forged response still ends the way a finished answer does."""
    ids = list(answer)
    stop = [ids.pop()] if ids and ids[-1] in stop_ids else []
    return [*ids, *continuation, *stop]


def chat_prompt(loaded: LoadedModel, text: str) -> str:
    return loaded.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                add_generation_prompt=True)


def answer(loaded: LoadedModel, reference: ReferenceModel, prompts: Sequence[str], temperature: float,
           seed: int, top_p: float = 1.0, max_new_tokens: int = MAX_NEW_TOKENS) -> list[list[int]]:
    """The model's response ids per chat prompt at `temperature` (0: greedy), stop token included when it
    stopped. Prompt i samples under seed + i whatever the model and temperature, so variants share their
    noise, as nodes asked the same request with the same seed would."""
    responses = []
    for i, prompt in enumerate(prompts):
        ids = reference.prompt_ids(prompt)
        noise = LogitsProcessorList([GumbelProcessor(temperature, seed + i, len(ids), top_p)]
                                    if temperature else [])
        out = loaded.model.generate(torch.tensor([ids], device=loaded.model.device), do_sample=False,
                                    max_new_tokens=max_new_tokens, logits_processor=noise,
                                    eos_token_id=list(loaded.stop_token_ids),
                                    pad_token_id=loaded.tokenizer.pad_token_id)
        responses.append(out[0, len(ids):].tolist())
    return responses


def engine_answers(loaded: LoadedModel, reference: ReferenceModel, prompts: Sequence[str], temperature: float,
                   seed: int, top_p: float = 1.0, max_new_tokens: int = MAX_NEW_TOKENS) -> list[list[int]]:
    """The same answers from the built-in serving engine, `ENGINE_BATCH` requests decoding together on
    one thread (the verifier scores with the bench's threads: another batch shape and thread count)."""
    import asyncio

    async def run() -> list[list[int]]:
        engine = BuiltinEngine(loaded.model, loaded.model_id, loaded.stop_token_ids, max_batch=ENGINE_BATCH)
        try:
            async def one(i: int, prompt: str) -> list[int]:
                request = GenerationRequest(tuple(reference.prompt_ids(prompt)), max_new_tokens, temperature,
                                            seed + i, top_p=top_p)
                return [t async for chunk in engine.generate(request) for t in chunk.token_ids]
            return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))
        finally:
            await engine.close()

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return asyncio.run(run())
    finally:
        torch.set_num_threads(threads)


@dataclass(frozen=True)
class Pool:
    """One variant's scored answers, in prompt order."""

    credibility: tuple[float, ...]
    calibrated: tuple[float, ...]
    tokens: tuple[int, ...]
    deviations: tuple[int, ...] = ()
    """Per answer, its tokens beyond the verifier's tolerance."""
    worst: float = 0.0
    """The largest shortfall of any token (nats)."""

    def values(self, definition: str) -> tuple[float, ...]:
        return self.credibility if definition == "1/PPL" else self.calibrated


def score(reference: ReferenceModel, prompts: Sequence[str], responses: Sequence[Sequence[int]],
          claimed_id: str, temperature: float, seed: int, top_p: float = 1.0) -> Pool:
    """Sign every response as a node claiming the reference's model, asked for answers at `temperature`
    and `top_p` (prompt i with seed + i), and run the verifier's checks and scoring on it, as the
    committee does."""
    keys = KeySet.generate()
    answers = []
    for i, (prompt, ids) in enumerate(zip(prompts, responses, strict=True)):
        text = reference.tokenizer.decode(ids, skip_special_tokens=True)
        answers.append(Answer(sign_response(keys, prompt, list(ids), text, claimed_id, 0, "bench:0",
                                            milli(temperature), seed + i, milli(top_p)), prompt))
    verdicts = reference.verify(answers)
    bad = [v for v in verdicts if not v.ok]
    if bad:
        raise RuntimeError(f"{len(bad)} answers rejected, first: {bad[0].rejection}: {bad[0].detail}")
    pairs = [(reference.prompt_ids(p), list(r)) for p, r in zip(prompts, responses, strict=True)]
    decodings = [Decoding(temperature, seed + i, top_p, reference.tolerance) for i in range(len(pairs))]
    worst = max(max(s.shortfalls or (0.0,)) for s in reference.scorer.score_choices(pairs, decodings))
    return Pool(tuple(v.credibility for v in verdicts), tuple(v.calibrated for v in verdicts),
                tuple(v.tokens for v in verdicts), tuple(v.deviations for v in verdicts), worst)


def build_pools(data_dir: str | None, count: int, seed: int = 0
                ) -> tuple[list[str], dict[tuple[str, str], Pool]]:
    """The challenge questions and every (variant, decoding) pool, scored by gt."""
    questions = challenge_prompts(count, seed)
    gt = load(HONEST, data_dir)
    reference = ReferenceModel.from_loaded(gt, calibrated=True)
    prompts = [chat_prompt(gt, q) for q in questions]
    baits = [chat_prompt(gt, clickbait(q)) for q in questions]
    continuations = [reference.tokenizer("\n\n" + c, add_special_tokens=False)["input_ids"]
                     for c in CONTINUATIONS]
    pools: dict[tuple[str, str], Pool] = {}
    for name in MODELS:
        loaded = gt if name == HONEST else load(name, data_dir)
        for decoding, (temperature, top_p) in SAMPLING.items():
            sampled = {"temperature": temperature, "seed": seed, "top_p": top_p}
            responses = answer(loaded, reference, prompts, **sampled)
            pools[name, decoding] = score(reference, prompts, responses, gt.model_id, **sampled)
            if name == HONEST:
                served = engine_answers(gt, reference, prompts, **sampled)
                pools[ENGINE, decoding] = score(reference, prompts, served, gt.model_id, **sampled)
                forged = [inject(r, continuations[i % len(continuations)], gt.stop_token_ids)
                          for i, r in enumerate(responses)]
                pools["gt_ic", decoding] = score(reference, prompts, forged, gt.model_id, **sampled)
                baited = answer(gt, reference, baits, **sampled)
                pools["gt_cb", decoding] = score(reference, prompts, baited, gt.model_id, **sampled)
    ordered = {(v, d): pools[v, d] for v in VARIANTS for d in DECODINGS}
    ordered |= {(NONGREEDY, d): pools[HONEST if d == "greedy" else "small", d] for d in DECODINGS}
    return questions, ordered


def auc(honest: Sequence[float], other: Sequence[float]) -> float:
    """Mann-Whitney AUC: P(honest > other) + P(tie) / 2 over all pairs."""
    if not honest or not other:
        raise ValueError("AUC needs scores on both sides")
    wins = sum((h > o) + 0.5 * (h == o) for h in honest for o in other)
    return wins / (len(honest) * len(other))


def quartiles(values: Sequence[float]) -> tuple[float, float, float]:
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def trajectory(rule: ReputationRule, epoch_credibilities: Sequence[int]) -> list[int]:
    """Reputation ppm from the initial value through each epoch's C(T), by the ledger's update."""
    reputations, window = [rule.initial], ()
    for c in epoch_credibilities:
        reputation, window = update(rule, reputations[-1], c, window)
        reputations.append(reputation)
    return reputations


def draws(pool_size: int, epochs: int, challenges: int, seed: int, label: str) -> np.ndarray:
    """Indices of the answers a node gives, epochs x challenges, from a generator seeded by seed and
    node, so both credibility definitions see the same answers."""
    rng = np.random.default_rng([seed, zlib.crc32(label.encode())])
    return rng.integers(pool_size, size=(epochs, challenges))


def mix_draws(pool_size: int, epochs: int, challenges: int, seed: int, label: str
              ) -> tuple[np.ndarray, np.ndarray]:
    """Each challenge's decoding (an index into DECODINGS, drawn independently with the workload's weights,
    as the verifier draws its challenges) and answer index, epochs x challenges, seeded like `draws`."""
    rng = np.random.default_rng([seed, zlib.crc32(label.encode())])
    weights = np.array([MIX_WEIGHTS[d] for d in DECODINGS], dtype=float)
    decodings = rng.choice(len(DECODINGS), size=(epochs, challenges), p=weights / weights.sum())
    return decodings, rng.integers(pool_size, size=(epochs, challenges))


@dataclass(frozen=True)
class Answers:
    """A node's pool as the ledger sees each answer: credibility ppm, tokens, deviating tokens."""

    ppm: Sequence[int]
    tokens: Sequence[int]
    deviations: Sequence[int]


def epoch_credibilities(answers: Answers, picks: np.ndarray, rule: EvidenceRule | None = None) -> list[int]:
    """C(T) per epoch as the ledger takes it: the product of that epoch's answers, 0 while the evidence
    across epochs (under `rule`; none for 1/PPL, which counts no deviations) flags the node."""
    cusum, out = 0, []
    for row in picks:
        value = product([answers.ppm[i] for i in row])
        if rule is not None:
            cusum = accumulate(rule, cusum, sum(answers.tokens[i] for i in row),
                               sum(answers.deviations[i] for i in row))
            value = 0 if flagged(rule, cusum) else value
        out.append(value)
    return out


def first_untrusted(rule: ReputationRule, reputations: Sequence[int]) -> int | None:
    """The first epoch (1-based) after which the node is untrusted, None if it never is."""
    return next((t for t, r in enumerate(reputations) if t and not is_trusted(rule, r)), None)


@dataclass(frozen=True)
class Outcome:
    """Trajectories of one node over seeds."""

    trajectories: np.ndarray
    flagged_at: list[int | None]

    def share_flagged(self, within: int) -> float:
        return sum(t is not None and t <= within for t in self.flagged_at) / len(self.flagged_at)

    def median_epoch(self) -> float | None:
        epochs = [t for t in self.flagged_at if t is not None]
        return statistics.median(epochs) if len(epochs) * 2 > len(self.flagged_at) else None


def node_credibilities(pools: dict[tuple[str, str], Answers], key: tuple[str, str], epochs: int,
                       challenges: int, seed: int, rule: EvidenceRule | None) -> list[int]:
    """C(T) per epoch of node `key`: answers from its own pool, or for a mix node from the pool of each
    challenge's drawn decoding (the pools concatenated in DECODINGS order, so one index picks both)."""
    label = "/".join(key)
    variant, decoding = key
    if decoding != MIX:
        size = len(pools[key].ppm)
        return epoch_credibilities(pools[key], draws(size, epochs, challenges, seed, label), rule)
    sizes = {len(pools[variant, d].ppm) for d in DECODINGS}
    if len(sizes) != 1:
        raise ValueError(f"{variant}'s pools differ in size: {sizes}")
    size = sizes.pop()
    chosen, picks = mix_draws(size, epochs, challenges, seed, label)
    joined = Answers(*([x for d in DECODINGS for x in getattr(pools[variant, d], f)]
                       for f in ("ppm", "tokens", "deviations")))
    return epoch_credibilities(joined, chosen * size + picks, rule)


def nodes(pools: dict[tuple[str, str], Pool]) -> list[tuple[str, str]]:
    """The simulated nodes: a mix node per variant that has a pool for every decoding (first: it is what a
    live network sees), then one per pool."""
    variants = dict.fromkeys(v for v, _ in pools)
    mixed = [(v, MIX) for v in variants if all((v, d) in pools for d in DECODINGS)]
    return [*mixed, *pools]


def simulate(pools: dict[tuple[str, str], Pool], definition: str, gamma: int, seeds: int, challenges: int,
             epochs: int = EPOCHS, params: Params | None = None) -> dict[tuple[str, str], Outcome]:
    """Every node of `nodes(pools)` over `seeds` runs, under `params` (the defaults) with gamma replaced."""
    rule = replace(ReputationRule.from_params(params or Params()), gamma=gamma)
    evidence_rule = EvidenceRule.from_params(params or Params()) if definition == "calibrated" else None
    answers = {key: Answers([to_ppm(v) for v in pool.values(definition)], pool.tokens,
                            pool.deviations or (0,) * len(pool.tokens)) for key, pool in pools.items()}
    outcomes = {}
    for key in nodes(pools):
        rows, first = [], []
        for seed in range(seeds):
            credibilities = node_credibilities(answers, key, epochs, challenges, seed, evidence_rule)
            reputations = trajectory(rule, credibilities)
            rows.append(reputations)
            first.append(first_untrusted(rule, reputations))
        outcomes[key] = Outcome(np.array(rows) / PPM, first)
    return outcomes


def print_distributions(pools: dict[tuple[str, str], Pool], decoding: str) -> None:
    """Every variant's AUC against honest gt under each decoding: the same decoding says whether the rule
    separates them on that kind of challenge, the others whether one threshold on C(T) (which mixes the
    decodings) can."""
    print(f"\n### Credibility per answer, {decoding} answers\n")
    columns = (f"{d} mean | {d} q1 / median / q3 | " + " | ".join(f"{d} AUC vs gt {h}" for h in DECODINGS)
               for d in DEFINITIONS)
    print("| variant | tokens | answers deviating | deviating tokens | worst shortfall (nats) | "
          + " | ".join(columns) + " |")
    print("| --- | ---: | ---: | ---: | ---: |" + (" ---: |" * (2 + len(DECODINGS))) * len(DEFINITIONS))
    for variant in VARIANTS:
        pool = pools[variant, decoding]
        cells = [f"{sum(d > 0 for d in pool.deviations) / len(pool.deviations):.0%}",
                 f"{sum(pool.deviations) / sum(pool.tokens):.2%}", f"{pool.worst:.2g}"]
        for d in DEFINITIONS:
            values = pool.values(d)
            q1, q2, q3 = quartiles(values)
            cells += [f"{statistics.fmean(values):.4f}", f"{q1:.4f} / {q2:.4f} / {q3:.4f}"]
            cells += ["-" if (variant, decoding) == (HONEST, h) else
                      f"{auc(pools[HONEST, h].values(d), values):.3f}" for h in DECODINGS]
        print(f"| {variant} | {statistics.fmean(pool.tokens):.0f} | " + " | ".join(cells) + " |")


def percent(share: float) -> str:
    """A share of seeds in whole percent, but never rounded to 0% or 100% when it is not."""
    return f"{share:.1%}" if 0 < share < 0.01 or 0.99 < share < 1 else f"{share:.0%}"


def print_reputation(outcomes: dict[str, dict[tuple[str, str], Outcome]], definition: str, challenges: int,
                     seeds: int) -> None:
    print(f"\n### Reputation, {definition}, {challenges} challenge(s) per epoch, {seeds} seeds\n")
    print("| node | " + " | ".join(f"γ={g}: untrusted ≤ {DETECT_WITHIN} ep. / ever / median first epoch / "
                                   "final R" for g in GAMMAS) + " |")
    print("| --- |" + " ---: |" * len(GAMMAS))
    for key in outcomes["1"]:
        cells = []
        for g in GAMMAS:
            o = outcomes[g][key]
            epoch = o.median_epoch()
            final = float(np.median(o.trajectories[:, -1]))
            cells.append(f"{percent(o.share_flagged(DETECT_WITHIN))} / {percent(o.share_flagged(EPOCHS))} / "
                         f"{'-' if epoch is None else f'{epoch:g}'} / {final:.3f}")
        print(f"| {key[0]} {key[1]} | " + " | ".join(cells) + " |")


def verdict(outcomes: dict[str, dict[tuple[str, str], Outcome]], definition: str, challenges: int) -> None:
    """The paper's two targets at gamma = 1/5, under the mix (the headline) and per decoding, and every
    honest node's false-flag rate over 35 epochs."""
    strict = outcomes["1/5"]
    print(f"\n{definition}, {challenges} challenge(s)/epoch, γ=1/5: dishonest untrusted within "
          f"{DETECT_WITHIN} epochs in every seed:")
    for decoding in (MIX, *DECODINGS):
        missed = [f"{v} ({percent(o.share_flagged(DETECT_WITHIN))})" for (v, d), o in strict.items()
                  if d == decoding and v != HONEST and o.share_flagged(DETECT_WITHIN) < 1]
        print(f"  {decoding}: {'all' if not missed else 'not ' + ', '.join(missed)}")
    for g, by_node in outcomes.items():
        rates = ", ".join(f"gt {d} {o.share_flagged(EPOCHS):.1%}" for (v, d), o in by_node.items()
                          if v == HONEST)
        print(f"  honest false-flag rate over {EPOCHS} epochs, γ={g}: {rates} (target 0)")


COLOURS = {"gt": "tab:green", ENGINE: "tab:cyan", NONGREEDY: "tab:pink",
           "small": "tab:orange", "tiny": "tab:red", "gt-int8": "tab:olive",
           "gt-int4": "tab:brown", "gt_cb": "tab:purple", "gt_ic": "tab:blue"}


def plot_distributions(pools: dict[tuple[str, str], Pool], path: Path, decoding: str, abnormal: float
                       ) -> None:
    """Figure 10: every answer's credibility per variant (points over a box), one panel per definition."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    jitter = np.random.default_rng(0)
    for ax, definition in zip(axes, DEFINITIONS, strict=True):
        data = [pools[v, decoding].values(definition) for v in VARIANTS]
        ax.boxplot(data, showfliers=False, widths=0.5)
        for i, (variant, values) in enumerate(zip(VARIANTS, data, strict=True), start=1):
            ax.scatter(i + jitter.uniform(-0.18, 0.18, len(values)), values, s=10, alpha=0.6,
                       color=COLOURS[variant])
        ax.set_xticks(range(1, len(VARIANTS) + 1), VARIANTS)
        ax.axhline(abnormal, color="grey", linestyle=":", linewidth=1, label=f"τ = {abnormal:g}")
        if definition == "1/PPL":
            ax.set_yscale("log")
        temperature, top_p = SAMPLING[decoding]
        ax.set_title(f"{definition} credibility ({decoding} answers, T = {temperature:g}, top_p = {top_p:g}, "
                     "reference gt)")
        ax.legend(loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_reputation(outcomes: dict[str, dict[tuple[str, str], Outcome]], path: Path, definition: str,
                    challenges: int, untrusted: float) -> None:
    """Figure 11: median reputation over seeds (10-90% band) per node, one panel per gamma (columns) and
    per kind of node (rows: the mix, then each decoding alone)."""
    import matplotlib.pyplot as plt

    rows = (MIX, *DECODINGS)
    fig, axes = plt.subplots(len(rows), len(GAMMAS), figsize=(15, 3.6 * len(rows)), sharex=True, sharey=True)
    for row, decoding in zip(axes, rows, strict=True):
        for ax, (g, by_node) in zip(row, outcomes.items(), strict=True):
            for (variant, d), o in by_node.items():
                if d != decoding:
                    continue
                x = np.arange(o.trajectories.shape[1])
                lo, mid, hi = np.percentile(o.trajectories, [10, 50, 90], axis=0)
                ax.plot(x, mid, color=COLOURS[variant], label=variant)
                ax.fill_between(x, lo, hi, color=COLOURS[variant], alpha=0.12)
            ax.axhline(untrusted, color="grey", linestyle=":", linewidth=1)
            ax.set_title(f"{decoding} nodes, γ = {g} ({definition}, {challenges} challenges/epoch)",
                         fontsize=10)
        row[0].set_ylabel("reputation")
    for ax in axes[-1]:
        ax.set_xlabel("epoch")
    fig.legend(*axes[0][0].get_legend_handles_labels(), loc="lower center", ncol=len(VARIANTS))
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help=f"the quick family in {QUICK_DATA}, 12 prompts, 40 seeds, figures in a temp dir")
    parser.add_argument("--data-dir", default=None, help="the family's data directory")
    parser.add_argument("--prompts", type=int, default=50)
    parser.add_argument("--seeds", type=int, default=200)
    parser.add_argument("--challenges", type=int, default=3, help="challenges per node per epoch")
    parser.add_argument("--abnormal", type=int, default=Params.abnormal_threshold_ppm,
                        help="abnormal credibility threshold τ, ppm")
    parser.add_argument("--untrusted", type=int, default=Params.untrusted_threshold_ppm,
                        help="untrusted reputation threshold, ppm")
    parser.add_argument("--figures", default=None, help="where the PNGs go (default docs/figures)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.quick:
        args.data_dir = args.data_dir or QUICK_DATA
        args.prompts, args.seeds = 12, 40
        args.figures = args.figures or tempfile.mkdtemp(prefix="ps-detection-")
    figures = Path(args.figures or Path(__file__).resolve().parent.parent / "docs" / "figures")
    figures.mkdir(parents=True, exist_ok=True)
    if args.threads:
        torch.set_num_threads(args.threads)
    import matplotlib

    matplotlib.use("Agg")

    t0 = time.perf_counter()
    questions, pools = build_pools(args.data_dir, args.prompts)
    print(f"{len(questions)} challenge prompts, e.g. {questions[0]!r} -> clickbait "
          f"{clickbait(questions[0])!r}; answers generated and scored in {time.perf_counter() - t0:.1f} s")
    params = Params(abnormal_threshold_ppm=args.abnormal, untrusted_threshold_ppm=args.untrusted)
    defaults = Params()
    same = (params.abnormal_threshold_ppm, params.untrusted_threshold_ppm) == (
        defaults.abnormal_threshold_ppm, defaults.untrusted_threshold_ppm)
    suffix = "" if same else f"_tau{args.abnormal / PPM:g}_untrusted{args.untrusted / PPM:g}"
    print(f"\nreputation: α={params.reputation_alpha_ppm / PPM:g}, β={params.reputation_beta_ppm / PPM:g}, "
          f"W={params.reputation_window}, τ={params.abnormal_threshold_ppm / PPM:g}, untrusted below "
          f"{params.untrusted_threshold_ppm / PPM:g}, initial {params.initial_reputation_ppm / PPM:g}")
    for decoding in DECODINGS:
        print_distributions(pools, decoding)
        plot_distributions(pools, figures / f"detection_credibility_{decoding}{suffix}.png", decoding,
                           args.abnormal / PPM)
    for challenges in dict.fromkeys((args.challenges, 1)):
        for definition in DEFINITIONS:
            outcomes = {g: simulate(pools, definition, gamma, args.seeds, challenges, params=params)
                        for g, gamma in GAMMAS.items()}
            print_reputation(outcomes, definition, challenges, args.seeds)
            verdict(outcomes, definition, challenges)
            if challenges == args.challenges:
                name = "ppl" if definition == "1/PPL" else "calibrated"
                path = figures / f"detection_reputation_{name}{suffix}.png"
                plot_reputation(outcomes, path, definition, challenges, params.untrusted_threshold_ppm / PPM)
    print(f"\nfigures in {figures}; total {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
