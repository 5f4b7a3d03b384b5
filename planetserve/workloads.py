"""Synthetic serving workloads with the published statistics of the PlanetServe evaluation.

No data set can be downloaded here, so each workload is rebuilt from its shape: a pool of shared
prefixes (tool instructions, programming problems, long documents) picked with Zipf popularity,
followed by a unique user question, with the paper's mean prompt lengths and output caps:

| workload | stands in for | pool | Zipf | mean prompt | output cap |
| --- | --- | --- | --- | --- | --- |
| tooluse | ToolBench | 3,451 tools | 1.1 | 7,206 | 100 |
| coding | APPS | 10,000 problems | 0.8 | 1,802 | 1,000 |
| longdoc | LooGLE | 776 documents | 0.6 | 10,985 | 100 |
| mixed | 3:6:1 of the three | | | 4,342 | |

Questions are generated per request (unique suffixes) rather than drawn from a fixed set such as
LooGLE's 6.4k. ToolUse prompts also share one system prompt before the tool's documentation.

The paper states 9,959 tokens for Mixed, which no 3:6:1 mix of the three can give (it would need
three quarters long documents); we keep the 3:6:1 request ratio and each component's own statistics,
so Mixed averages 0.3 * 7,206 + 0.6 * 1,802 + 0.1 * 10,985 = 4,342 tokens.

Text comes from English sentences of the standard library's docstrings (`planetserve.models.corpus`),
so every machine builds the same prompts without downloads. Token ids index a fixed vocabulary of
pre-tokenizer pieces (a word with its leading space, a run of up to three digits, a punctuation run,
a paragraph break), so `detokenize(prompt_ids)` is exactly the prompt's text and lengths count pieces,
which track a BPE tokenizer's count of ordinary English closely. The means are exact in expectation:
pool lengths are rescaled so that the Zipf-weighted mean prompt is the target.

Every prompt ends with a question built from an imperative docstring sentence ("How can I return the
number of items in the queue?"), so a challenge prompt made here looks like any other user prompt.

Each request also says how it is sent and sampled: half as a chat message (the rest as a bare
completion prompt), half of them streamed; greedily for half of them, at temperature 0.7 or 1.0 (the
API's default) for a quarter each; a quarter of them ask for nucleus sampling at top_p 0.9; a tenth ask
for each token's log-probability with 0-5 alternatives. The traces publish none of this; the mix is
ours, and the verifier's challenges draw from it too, so that none of it tells a challenge apart.
"""

from __future__ import annotations

import itertools
import math
import random
import re
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from functools import cache

import numpy as np

WORKLOADS = ("tooluse", "coding", "longdoc", "mixed")
MIXED_RATIO = {"tooluse": 3, "coding": 6, "longdoc": 1}
OUTPUT_RANGE_RATIO = 0.5
"""Output lengths are uniform in [ratio * cap, cap], like SGLang bench_serving's --random-range-ratio:
the paper gives only the caps."""
QUESTION_SIGMA = 0.5
"""Log-normal shape of question lengths (their mean is the workload's question_mean)."""
TEMPERATURES = {0.0: 2, 0.7: 1, 1.0: 1}
"""Sampling temperatures of new requests and their weights; a follow-up keeps its session's."""
DEFAULT_TEMPERATURE = 1.0
TOP_PS = {1.0: 3, 0.9: 1}
"""The nuclei (OpenAI's `top_p`) of new requests and their weights; a follow-up keeps its session's."""
CHAT_SHARE = 0.5
"""The share of new requests sent as a one-message chat rather than a completion prompt."""
STREAM_SHARE = 0.5
"""The share of new requests whose program asks for the answer streamed; a follow-up keeps its
session's."""
LOGPROBS_SHARE = 0.1
"""The share of new requests whose program asks for each token's log-probability (OpenAI's `logprobs`),
with a number of alternatives drawn uniformly from 0..MAX_TOP_LOGPROBS; a follow-up keeps its
session's."""
MAX_TOP_LOGPROBS = 5
STOP_SHARE = 0.1
"""The share of new requests whose program asks the answer to end at a stop string (OpenAI's `stop`),
drawn from STOPS; a follow-up keeps its session's."""
STOPS = {("\n\n",): 2, ("\n",): 1, (".",): 1, ("\n\n", "Question:"): 1}
"""The stop strings programs ask for and their weights: the end of a paragraph, a line or a sentence, or
of an answer before the next question."""
STOP_AS_IDS_SHARE = 0.25
"""Of the requests with stop strings, the share whose program sends them as token ids (vLLM's
`stop_token_ids`): each string that is one token of the model's, the others as strings
(`stop_fields`)."""
FOLLOWUP_SHARE = 0.25
"""The chance that a user's request continues a recent session (ours: the traces publish none); what
`generate` is told by callers that model users' traffic as a whole, challenges included."""

_PIECE = re.compile(r"\n\n| ?[^\W\d_]+| ?\d{1,3}| ?_+| ?[^\w\s]+| ")
_SENTENCE_SPLIT = re.compile(r"(?<=[.?!])\s+(?=[A-Z])")
_PLAIN_SENTENCE = re.compile(r"^[A-Z][A-Za-z0-9 ,;:'()\-]*[a-z0-9)]\.$")
PARAGRAPH = "\n\n"

_IMPERATIVES = frozenset({
    "Add", "Build", "Calculate", "Change", "Check", "Close", "Compare", "Compute", "Construct", "Convert",
    "Copy", "Create", "Decode", "Delete", "Determine", "Encode", "Extract", "Find", "Format", "Generate",
    "Get", "Handle", "Initialize", "Insert", "Load", "Make", "Open", "Parse", "Print", "Process", "Read",
    "Register", "Remove", "Replace", "Reset", "Return", "Save", "Search", "Send", "Set", "Split", "Start",
    "Stop", "Translate", "Update", "Wait", "Write"
})
_QUESTIONS = {
    "tooluse": (
        "Which tool should I call to {}?", "How can I {} with the tools above?",
        "Can you help me {}?", "What is the right way to {}?", "Is there a tool that lets me {}?",
    ),
    "coding": (
        "Can you write a Python function to {}?", "How would you implement code to {}?",
        "Could you show me a short program that can {}?", "What is an efficient way to {}?",
        "How do I write a solution that needs to {}?",
    ),
    "longdoc": (
        "According to the document, how do I {}?", "What does the text above say about how to {}?",
        "Based on the document, which part explains how to {}?", "How does the document suggest we {}?",
        "Where in the text does it explain how to {}?",
    ),
}
_HEADERS = {
    "tooluse": (
        "You are a helpful assistant that can call the tools described below. Read the documentation "
        "of each tool carefully, pick the tools that fit the user's request, and explain how to use "
        "them. Answer briefly and say which tool you would call first."
    ),
    "coding": (
        "Solve the following programming problem. Read the description, then answer the question "
        "that follows it with working Python code and a short explanation."
    ),
    "longdoc": "Read the document below and answer the question that follows it.",
}


@dataclass(frozen=True)
class Request:
    id: int
    arrival: float
    """Seconds from the start of the run."""
    workload: str
    prefix_id: str
    """The shared prefix (tool, problem, document, SGLang group) this prompt starts with."""
    prefix_ids: tuple[int, ...] = field(repr=False)
    """Shared by every request with this prefix_id (one object, so a pool costs its size once)."""
    suffix_ids: tuple[int, ...] = field(repr=False)
    max_tokens: int
    output_len: int
    """How many tokens a simulated model generates before stopping (at most max_tokens)."""
    session: str | None = None
    """Set on follow-ups and their first turn: the prompt extends the session's previous prompt."""
    temperature: float = DEFAULT_TEMPERATURE
    chat: bool = False
    """Sent as the user message of a chat (rendered by the model's template) rather than as raw text."""
    stream: bool = False
    """Whether the program asks for the answer streamed."""
    top_p: float = 1.0
    logprobs: int | None = None
    """The log-probability alternatives per token the program asks for; None: no log-probabilities."""
    stop: tuple[str, ...] = ()
    """The stop strings the program asks for (none: the answer ends at a stop token or its cap)."""
    stop_as_ids: bool = False
    """Whether the program sends its stop strings as token ids where it can (`stop_fields`)."""

    @property
    def prompt_ids(self) -> tuple[int, ...]:
        return self.prefix_ids + self.suffix_ids

    @property
    def prompt_len(self) -> int:
        return len(self.prefix_ids) + len(self.suffix_ids)

    @property
    def text(self) -> str:
        return detokenize(self.prompt_ids)


@dataclass(frozen=True)
class Vocabulary:
    pieces: tuple[str, ...]
    index: dict[str, int] = field(repr=False)
    sentences: tuple[tuple[int, ...], ...] = field(repr=False)
    """Every plain English docstring sentence, tokenized with a leading space, in corpus order
    (consecutive ones come from the same docstring, so a run of them reads like one document)."""
    tasks: tuple[tuple[int, ...], ...] = field(repr=False)
    """Imperative sentences as the tail of a question (" return the number of items")."""
    unspaced: dict[int, int] = field(repr=False)
    """A leading-space piece's id to the id of the same piece without it (for paragraph starts)."""


def _plain_sentences() -> list[str]:
    from planetserve.models.corpus import build_corpus

    seen: set[str] = set()
    sentences = []
    for document in build_corpus().documents:
        for paragraph in document.text.split("\n\n"):
            if paragraph.startswith(("    ", ">>>")):
                continue
            for sentence in _SENTENCE_SPLIT.split(" ".join(paragraph.split())):
                words = sentence.split()
                if 6 <= len(words) <= 30 and _PLAIN_SENTENCE.match(sentence) and sentence not in seen:
                    seen.add(sentence)
                    sentences.append(sentence)
    return sentences


def _task(sentence: str) -> str | None:
    verb, _, rest = sentence.partition(" ")
    rest = rest[:-1]
    if verb not in _IMPERATIVES or "(" in rest or len(rest.split()) > 16 or not rest[-1].isalnum():
        return None
    return f" {verb.lower()} {rest}"


@cache
def vocabulary() -> Vocabulary:
    """Built once per process from the stdlib's docstrings (a few seconds)."""
    plain = _plain_sentences()
    sentences = [" " + s for s in plain]
    tasks = [t for t in map(_task, plain) if t is not None]
    templates = [" " + part.strip() for qs in _QUESTIONS.values() for q in qs for part in q.split("{}")]
    texts = [*sentences, *tasks, *templates, *_HEADERS.values(), PARAGRAPH]
    spaced = {p for t in texts for p in _PIECE.findall(t)}
    pieces = sorted(spaced | {p[1:] for p in spaced if p.startswith(" ") and len(p) > 1})
    index = {p: i for i, p in enumerate(pieces)}
    unspaced = {i: index[p[1:]] for p, i in index.items() if p.startswith(" ") and len(p) > 1}

    def encode(text: str) -> tuple[int, ...]:
        return tuple(index[p] for p in _PIECE.findall(text))

    return Vocabulary(tuple(pieces), index, tuple(map(encode, sentences)), tuple(map(encode, tasks)),
                      unspaced)


def tokenize(text: str) -> tuple[int, ...]:
    """Token ids of text made of this vocabulary's pieces (KeyError on a piece it does not know)."""
    pieces = _PIECE.findall(text)
    if sum(map(len, pieces)) != len(text):
        raise ValueError("text has characters outside the workload vocabulary's pieces")
    index = vocabulary().index
    return tuple(index[p] for p in pieces)


def detokenize(ids: Sequence[int]) -> str:
    pieces = vocabulary().pieces
    return "".join(pieces[i] for i in ids)


@dataclass(frozen=True)
class WorkloadSpec:
    pool: int
    zipf: float
    prompt_mean: float
    """Mean prompt length over requests, header and question included."""
    question_mean: float
    prefix_sigma: float
    """Log-normal shape of the pool's prefix lengths."""
    output_cap: int


SPECS = {
    "tooluse": WorkloadSpec(pool=3451, zipf=1.1, prompt_mean=7206, question_mean=260, prefix_sigma=0.6,
                            output_cap=100),
    "coding": WorkloadSpec(pool=10000, zipf=0.8, prompt_mean=1802, question_mean=90, prefix_sigma=0.5,
                           output_cap=1000),
    "longdoc": WorkloadSpec(pool=776, zipf=0.6, prompt_mean=10985, question_mean=40, prefix_sigma=0.4,
                            output_cap=100),
}


def zipf_probabilities(n: int, exponent: float) -> np.ndarray:
    weights = np.arange(1, n + 1, dtype=float) ** -exponent
    return weights / weights.sum()


def poisson_arrivals(rate: float, rng: np.random.Generator, *, count: int | None = None,
                     duration: float | None = None) -> list[float]:
    """Arrival times of a Poisson process: `count` of them, or all before `duration` seconds.
    An infinite rate puts every arrival at 0 (a closed burst, like SGLang's --request-rate inf)."""
    if count is None and duration is None:
        raise ValueError("give count or duration")
    if math.isinf(rate):
        if count is None:
            raise ValueError("an infinite rate needs a count")
        return [0.0] * count
    times: list[float] = []
    now = 0.0
    while count is None or len(times) < count:
        now += float(rng.exponential(1.0 / rate))
        if duration is not None and now >= duration:
            break
        times.append(now)
    return times


class _Writer:
    """Fills token budgets with whole sentences, stopping at the sentence boundary nearest the target."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.vocab = vocabulary()

    def lead(self, ids: list[int]) -> list[int]:
        """The same text starting a paragraph: its first piece without the leading space."""
        if ids:
            ids[0] = self.vocab.unspaced.get(ids[0], ids[0])
        return ids

    def _fill(self, target: int, next_sentence: Iterator[tuple[int, ...]], at_least_one: bool) -> list[int]:
        out: list[int] = []
        for sentence in next_sentence:
            if abs(len(out) + len(sentence) - target) >= abs(len(out) - target) and (out or not at_least_one):
                break
            out.extend(sentence)
        return out

    def run(self, target: int) -> list[int]:
        """Consecutive sentences from a random place in the corpus: reads like one document."""
        sentences = self.vocab.sentences
        start = self.rng.randrange(len(sentences))
        ordered = (sentences[(start + i) % len(sentences)] for i in itertools.count())
        return self.lead(self._fill(target, ordered, at_least_one=True))

    def scattered(self, target: int) -> list[int]:
        sentences = self.vocab.sentences
        randoms = (sentences[self.rng.randrange(len(sentences))] for _ in itertools.count())
        return self._fill(target, randoms, at_least_one=False)

    def question(self, workload: str, target: int) -> list[int]:
        """Context sentences if the budget has room, then the question, so the prompt ends with '?'."""
        before, after = self.rng.choice(_QUESTIONS[workload]).split("{}")
        ask = [*tokenize(" " + before.strip()), *self.rng.choice(self.vocab.tasks), *tokenize(after)]
        return self.lead([*self.scattered(target - len(ask)), *ask])


def _scaled(length: float, scale: float) -> int:
    return max(1, round(length * scale))


class _Source:
    """One workload's prefix pool; a prefix's text is written on first use, so a run pays only for
    the prefixes its requests pick."""

    def __init__(self, name: str, seed: int, scale: float) -> None:
        spec = SPECS[name]
        self.name, self.spec, self.scale, self.seed = name, spec, scale, seed
        self.cdf = np.cumsum(zipf_probabilities(spec.pool, spec.zipf))
        self.header = tokenize(_HEADERS[name] + PARAGRAPH)
        lengths = np.random.default_rng([seed, zlib.crc32(name.encode())]).lognormal(
            0.0, spec.prefix_sigma, spec.pool)
        body_mean = max(1.0, (spec.prompt_mean - spec.question_mean) * scale - len(self.header) - 1)
        lengths *= body_mean / float(lengths @ np.diff(self.cdf, prepend=0.0))
        self.body_lengths = [max(1, round(x)) for x in lengths]
        self.prefixes: dict[int, tuple[int, ...]] = {}
        self.cap = _scaled(spec.output_cap, scale)

    def prefix(self, rank: int) -> tuple[int, ...]:
        if rank not in self.prefixes:
            writer = _Writer(random.Random(f"{self.name}:{self.seed}:{rank}"))
            self.prefixes[rank] = (*self.header, *writer.run(self.body_lengths[rank]), *tokenize(PARAGRAPH))
        return self.prefixes[rank]

    def request(self, rid: int, arrival: float, rng: np.random.Generator, writer: _Writer) -> Request:
        rank = min(int(np.searchsorted(self.cdf, rng.random(), side="right")), self.spec.pool - 1)
        question = rng.lognormal(math.log(self.spec.question_mean) - QUESTION_SIGMA**2 / 2, QUESTION_SIGMA)
        suffix = writer.question(self.name, _scaled(question, self.scale))
        output = int(rng.integers(max(1, round(OUTPUT_RANGE_RATIO * self.cap)), self.cap + 1))
        return Request(rid, arrival, self.name, f"{self.name}/{rank}", self.prefix(rank), tuple(suffix),
                       self.cap, output)


def _follow_up(parent: Request, session: str, rid: int, arrival: float, writer: _Writer,
               scale: float) -> Request:
    """The next turn: the parent's whole prompt, a stand-in for its answer, then a new question."""
    answer = writer.lead(writer.scattered(parent.output_len))
    question = writer.question(parent.workload, _scaled(SPECS[parent.workload].question_mean, scale))
    paragraph = tokenize(PARAGRAPH)
    suffix = (*parent.suffix_ids, *paragraph, *answer, *paragraph, *question)
    return Request(rid, arrival, parent.workload, parent.prefix_id, parent.prefix_ids, suffix,
                   parent.max_tokens, parent.output_len, session, parent.temperature, parent.chat,
                   parent.stream, parent.top_p, parent.logprobs, parent.stop, parent.stop_as_ids)


def _weighted(weights: dict[float, int], rng: np.random.Generator) -> Iterator[float]:
    """An endless draw from `weights` (value: weight), on its own generator so the other draws do not
    shift."""
    values = sorted(weights)
    cdf = np.cumsum([weights[v] for v in values], dtype=float)
    cdf /= cdf[-1]
    while True:
        yield values[min(int(np.searchsorted(cdf, rng.random(), side="right")), len(values) - 1)]


def _logprobs(rng: np.random.Generator) -> int | None:
    """Whether a new request asks for log-probabilities (LOGPROBS_SHARE), and with how many alternatives."""
    asked = rng.random() < LOGPROBS_SHARE
    alternatives = int(rng.integers(MAX_TOP_LOGPROBS + 1))
    return alternatives if asked else None


def _stops(rng: np.random.Generator) -> Iterator[tuple[tuple[str, ...], bool]]:
    """Each new request's stop strings, none or (STOP_SHARE) a draw from STOPS, and whether its program
    sends them as token ids (STOP_AS_IDS_SHARE)."""
    stops = list(STOPS)
    chosen = _weighted(dict(enumerate(STOPS.values())), rng)
    while True:
        pick = stops[int(next(chosen))]
        asked, as_ids = rng.random() < STOP_SHARE, rng.random() < STOP_AS_IDS_SHARE
        yield (pick, as_ids) if asked else ((), False)


def stop_fields(stop: tuple[str, ...], as_ids: bool, encode: Callable[[str], Sequence[int]]
                ) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The stop strings and stop token ids a program sends for `stop`: with `as_ids`, each string that
    `encode` (the model's tokenizer, without special tokens) makes one token goes as that token's id,
    the rest as strings."""
    if not as_ids:
        return stop, ()
    single = {text: ids[0] for text in stop if len(ids := encode(text)) == 1}
    return tuple(text for text in stop if text not in single), tuple(dict.fromkeys(single.values()))


def generate(
    workload: str,
    *,
    rate: float,
    duration: float | None = None,
    count: int | None = None,
    seed: int = 0,
    scale: float = 1.0,
    followup: float = 0.0,
    mix: dict[str, int] | None = None,
) -> list[Request]:
    """Requests in arrival order: Poisson arrivals at `rate` per second, `count` of them or all in
    `duration` seconds. `scale` multiplies every length (prompts and output caps) for small-context
    engines; `followup` is the chance that a request continues a recent session of its workload
    rather than starting one (both turns then carry the session id); `mix` overrides Mixed's 3:6:1."""
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; choose from {', '.join(WORKLOADS)}")
    weights = (mix or MIXED_RATIO) if workload == "mixed" else {workload: 1}
    names = sorted(weights)
    shares = np.cumsum([weights[n] for n in names], dtype=float)
    shares /= shares[-1]
    sources = {n: _Source(n, seed, scale) for n in names}
    rng = np.random.default_rng([seed, 1])
    sampling = _weighted(TEMPERATURES, np.random.default_rng([seed, 4]))
    nuclei = _weighted(TOP_PS, np.random.default_rng([seed, 7]))
    forms = np.random.default_rng([seed, 5])
    streams = np.random.default_rng([seed, 6])
    asks = np.random.default_rng([seed, 8])
    stops = _stops(np.random.default_rng([seed, 9]))
    writer = _Writer(random.Random(f"questions:{seed}"))
    arrivals = poisson_arrivals(rate, np.random.default_rng([seed, 2]), count=count, duration=duration)
    recent: dict[str, list[Request]] = {n: [] for n in names}
    requests: list[Request] = []
    for rid, arrival in enumerate(arrivals):
        name = names[min(int(np.searchsorted(shares, rng.random(), side="right")), len(names) - 1)]
        pool = recent[name]
        if pool and rng.random() < followup:
            parent = pool.pop(int(rng.integers(len(pool))))
            session = parent.session or f"s{parent.id}"
            if parent.session is None:
                requests[parent.id] = replace(parent, session=session)
            request = _follow_up(requests[parent.id], session, rid, arrival, writer, scale)
        else:
            stop, as_ids = next(stops)
            request = replace(sources[name].request(rid, arrival, rng, writer), temperature=next(sampling),
                              chat=bool(forms.random() < CHAT_SHARE),
                              stream=bool(streams.random() < STREAM_SHARE), top_p=next(nuclei),
                              logprobs=_logprobs(asks), stop=stop, stop_as_ids=as_ids)
        pool.append(request)
        del pool[:-32]
        requests.append(request)
    return requests


def generated_shared_prefix(
    *,
    num_groups: int = 64,
    prompts_per_group: int = 16,
    system_prompt_len: int = 2048,
    question_len: int = 128,
    output_len: int = 256,
    rate: float = math.inf,
    seed: int = 0,
    scale: float = 1.0,
) -> list[Request]:
    """SGLang bench_serving's `generated-shared-prefix` data set (its defaults): groups of prompts
    that share one system prompt and differ in the question, shuffled, with Poisson arrivals."""
    writer = _Writer(random.Random(f"gsp:{seed}"))
    paragraph = tokenize(PARAGRAPH)
    system = [(*writer.run(_scaled(system_prompt_len, scale)), *paragraph) for _ in range(num_groups)]
    rows = [(g, tuple(writer.question("tooluse", _scaled(question_len, scale))))
            for g in range(num_groups) for _ in range(prompts_per_group)]
    writer.rng.shuffle(rows)
    cap = _scaled(output_len, scale)
    arrivals = poisson_arrivals(rate, np.random.default_rng([seed, 3]), count=len(rows))
    return [Request(i, t, "gsp", f"gsp/{g}", system[g], q, cap, cap)
            for i, ((g, q), t) in enumerate(zip(rows, arrivals, strict=True))]
