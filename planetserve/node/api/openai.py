"""The OpenAI-compatible API's requests and responses (as `vllm serve` speaks it), as pure functions over
JSON values.

The engine server, the model node and the user relay use it: request parsing with specific errors,
prompt rendering through a transformers tokenizer, response and SSE chunk builders (the events'
framing is `engine/wire.py`'s; detokenisation with stop strings is `models/detokenize.py`'s). vLLM
extensions kept: `return_token_ids` (per-choice `token_ids`, `prompt_token_ids` per completion choice /
per chat response, on the first stream chunk), `stop_token_ids`, `ignore_eos`,
`stream_options.continuous_usage_stats`, `return_tokens_as_token_ids` (logprobs' tokens as "token_id:N"),
prompts as token-id lists. Our own extension is the optional `planetserve` object (see
PlanetServeOptions).
"""

from __future__ import annotations

import json
import math
import re
import secrets
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from planetserve.models.prompts import adds_special_tokens
from planetserve.node.engine.base import MAX_LOGPROBS, GenerationRequest, Tokenizer, TokenLogprob
from planetserve.node.engine.wire import MAX_TOKEN_ID
from planetserve.registry import codec
from planetserve.registry.epochs import MILLI, SEED_BITS, milli, to_seed

Endpoint = Literal["completions", "chat"]

INT64 = 1 << 63
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant"})
SESSION_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
MAX_HOPS = 16
MAX_PROMPT_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5
"""OpenAI's bound on /v1/completions' `logprobs` (chat's `top_logprobs` goes to MAX_LOGPROBS, 20)."""


class ApiError(Exception):
    """An error answer in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def model_not_found(model: str) -> ApiError:
    return ApiError(404, f"The model `{model[:200]}` does not exist.", type="not_found_error",
                    code="model_not_found", param="model")


def too_large(message: str, code: str = "request_too_large") -> ApiError:
    return ApiError(413, message, code=code)


def overloaded(message: str = "The server is overloaded; retry later.") -> ApiError:
    return ApiError(503, message, type="server_error", code="overloaded")


def path_not_found(path: str) -> ApiError:
    return ApiError(404, f"There is no route {path[:200]}.", type="not_found_error", code="not_found")


def method_not_allowed(method: str, path: str, allowed: Iterable[str]) -> ApiError:
    return ApiError(405, f"{method[:16]} is not allowed on {path[:200]}; use {', '.join(sorted(allowed))}.",
                    code="method_not_allowed")


@dataclass(frozen=True)
class ApiLimits:
    """Bounds on a request, enforced before any tokenisation or generation."""

    max_body_bytes: int = 4 << 20
    max_prompt_token_ids: int = 1 << 20
    max_messages: int = 1024
    max_stop: int = 16
    max_stop_chars: int = 256
    max_stop_token_ids: int = 128
    max_temperature: float = 2.0
    max_json_containers: int = 1 << 16
    """Arrays and objects in one body: 4 MiB of `[[],...]` would be 85 MiB of Python lists."""
    max_json_values: int = (1 << 20) + (1 << 17)
    """All values in one body: a prompt of `max_prompt_token_ids` ids and the fields around it."""


DEFAULT_LIMITS = ApiLimits()


@dataclass(frozen=True)
class PlanetServeOptions:
    """The `planetserve` request extension; every field optional, unknown fields rejected.

    session_id: requests sharing it prefer the node that served the previous ones (its KV cache).
    hops: how many model nodes have forwarded this request already; a node refuses past MAX_HOPS.
    no_forward: serve on the receiving node or fail, never forward."""

    session_id: str | None = None
    hops: int = 0
    no_forward: bool = False


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str
    name: str | None = None


@dataclass(frozen=True)
class ApiRequest:
    endpoint: Endpoint
    model: str | None
    prompt: str | tuple[int, ...] | None = None
    messages: tuple[ChatMessage, ...] = ()
    max_tokens: int | None = None
    """None: as many as the context allows (chat's default; completions default to 16 like OpenAI)."""
    temperature: float = 1.0
    seed: int | None = None
    top_p: float = 1.0
    """Nucleus sampling (planetserve.sampling.nucleus); checked like every sampled token."""
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    return_token_ids: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    planetserve: PlanetServeOptions = field(default_factory=PlanetServeOptions)
    prompt_logprobs: int | None = None
    """vLLM's extension: score the prompt, returning each token's log-probability and this many more."""
    logprobs: int | None = None
    """Each generated token's log-probability and this many likeliest alternatives (chat's `logprobs: true`
    with `top_logprobs`, completions' `logprobs`); None: none asked for."""
    return_tokens_as_token_ids: bool = False
    """vLLM's extension: logprobs' tokens as "token_id:N" (an engine client maps them back exactly)."""


# -- parsing ----------------------------------------------------------------------------------------


def parse_json_body(raw: bytes, limits: ApiLimits = DEFAULT_LIMITS) -> dict[str, Any]:
    if len(raw) > limits.max_body_bytes:
        raise too_large(f"Request body of {len(raw)} bytes exceeds the limit of {limits.max_body_bytes}.")
    try:
        body = codec.json_loads_bounded(raw, limits.max_json_values, limits.max_json_containers)
    except codec.LimitExceeded as exc:
        raise too_large(f"Request body holds {exc}.") from None
    except codec.CodecError as exc:
        raise bad_request(f"Request body is not valid JSON: {str(exc)[:200]}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("Request body must be a JSON object.", code="invalid_json")
    return body


def _bool(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"`{name}` must be a boolean.", name)
    return value


def _int(body: dict[str, Any], name: str, lo: int, hi: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"`{name}` must be an integer.", name)
    if not lo <= value <= hi:
        raise bad_request(f"`{name}` must be between {lo} and {hi}, got {value}.", name)
    return value


def _number(body: dict[str, Any], name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise bad_request(f"`{name}` must be a finite number.", name)
    return float(value)


def _token_ids(value: Any, name: str, limit: int, *, allow_empty: bool = False) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise bad_request(f"`{name}` must be a list of token ids.", name)
    if not value and not allow_empty:
        raise bad_request(f"`{name}` must not be empty.", name)
    if len(value) > limit:
        raise too_large(f"`{name}` has {len(value)} token ids; at most {limit} are accepted.")
    for t in value:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= MAX_TOKEN_ID:
            raise bad_request(f"`{name}` must contain only non-negative integer token ids.", name)
    return tuple(value)


TRUNCATION = ("sampling is over the model's distribution (or its `top_p` nucleus) under the request's seed, "
              "so that every token can be checked (docs/architecture.md, \"Verifiable sampling\"); use "
              "`top_p` or lower `temperature` to sharpen it")


def _unsupported(body: dict[str, Any], name: str, *neutral: Any, why: str = "") -> None:
    """Options we do not implement are accepted only at a value that changes nothing."""
    value = body.get(name)
    if value is not None and value not in neutral:
        raise bad_request(f"`{name}` is not supported by this server{': ' + why if why else ''}.", name,
                          code="unsupported_parameter")


def _stop(body: dict[str, Any], limits: ApiLimits) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad_request("`stop` must be a string or a list of strings.", "stop")
    if len(stops) > limits.max_stop:
        raise bad_request(f"`stop` has {len(stops)} entries; at most {limits.max_stop}.", "stop")
    if any(not s or len(s) > limits.max_stop_chars for s in stops):
        raise bad_request(f"Each stop string must have 1 to {limits.max_stop_chars} characters.", "stop")
    return tuple(stops)


def _planetserve(value: Any) -> PlanetServeOptions:
    if value is None:
        return PlanetServeOptions()
    if not isinstance(value, dict):
        raise bad_request("`planetserve` must be an object.", "planetserve")
    unknown = set(value) - {"session_id", "hops", "no_forward"}
    if unknown:
        names = ", ".join(sorted(unknown))[:200]
        raise bad_request(f"Unknown `planetserve` field(s): {names}.", "planetserve")
    session = value.get("session_id")
    if session is not None and (not isinstance(session, str) or not SESSION_ID.fullmatch(session)):
        raise bad_request("`planetserve.session_id` must be 1-128 characters of [A-Za-z0-9._:-].",
                          "planetserve.session_id")
    hops = _int(value, "hops", 0, MAX_HOPS)
    return PlanetServeOptions(session, hops or 0, _bool(value, "no_forward", False))


def _common(body: dict[str, Any], endpoint: Endpoint, limits: ApiLimits) -> dict[str, Any]:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("`model` must be a string.", "model")
    for name in ("n", "best_of"):
        _unsupported(body, name, 1)
    for name in ("presence_penalty", "frequency_penalty", "min_p"):
        _unsupported(body, name, 0, 0.0)
    _unsupported(body, "repetition_penalty", 1, 1.0)
    _unsupported(body, "top_k", -1, 0, why=TRUNCATION)
    _unsupported(body, "logit_bias", {})
    _unsupported(body, "echo", False)
    temperature = _number(body, "temperature")
    if temperature is not None and not 0 <= temperature <= limits.max_temperature:
        raise bad_request(f"`temperature` must be between 0 and {limits.max_temperature}.", "temperature")
    top_p = _number(body, "top_p")
    if top_p is not None and not 0 <= top_p <= 1:
        raise bad_request("`top_p` must be between 0 and 1.", "top_p")
    stream = _bool(body, "stream", False)
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise bad_request("`stream_options` is only allowed when `stream` is true.", "stream_options")
        if not isinstance(options, dict):
            raise bad_request("`stream_options` must be an object.", "stream_options")
    options = options or {}
    stop_ids = body.get("stop_token_ids")
    return {
        "endpoint": endpoint,
        "model": model,
        "temperature": 1.0 if temperature is None else temperature,
        "seed": _int(body, "seed", -INT64, INT64 - 1),
        "top_p": 1.0 if top_p is None else top_p,
        "stream": stream,
        "include_usage": _bool(options, "include_usage", False),
        "continuous_usage": _bool(options, "continuous_usage_stats", False),
        "stop": _stop(body, limits),
        "stop_token_ids": () if stop_ids is None else _token_ids(
            stop_ids, "stop_token_ids", limits.max_stop_token_ids, allow_empty=True),
        "ignore_eos": _bool(body, "ignore_eos", False),
        "return_token_ids": _bool(body, "return_token_ids", False),
        "planetserve": _planetserve(body.get("planetserve")),
    }


def parse_completion_request(body: dict[str, Any], limits: ApiLimits = DEFAULT_LIMITS) -> ApiRequest:
    """/v1/completions: one prompt, as text or as token ids."""
    fields = _common(body, "completions", limits)
    _unsupported(body, "suffix", "")
    prompt = body.get("prompt")
    if prompt is None:
        raise bad_request("`prompt` is required.", "prompt", code="missing_required_parameter")
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        raise bad_request("Batched prompts are not supported; send one prompt per request.", "prompt")
    if not isinstance(prompt, str):
        prompt = _token_ids(prompt, "prompt", limits.max_prompt_token_ids)
    max_tokens = _int(body, "max_tokens", 1, INT64 - 1)
    prompt_logprobs = _int(body, "prompt_logprobs", 0, MAX_PROMPT_LOGPROBS)
    if prompt_logprobs is not None and fields["stream"]:
        raise bad_request("`prompt_logprobs` is not supported with `stream`.", "prompt_logprobs")
    return ApiRequest(prompt=prompt, max_tokens=16 if max_tokens is None else max_tokens,
                      prompt_logprobs=prompt_logprobs,
                      **_logprobs(body, _int(body, "logprobs", 0, MAX_COMPLETION_LOGPROBS)), **fields)


def _message(raw: Any, index: int) -> ChatMessage:
    where = f"messages[{index}]"
    if not isinstance(raw, dict):
        raise bad_request(f"`{where}` must be an object.", where)
    role = raw.get("role")
    if role not in CHAT_ROLES:
        raise bad_request(f"`{where}.role` must be one of {', '.join(sorted(CHAT_ROLES))}.", f"{where}.role")
    if raw.get("tool_calls") or raw.get("function_call"):
        raise bad_request(f"`{where}`: tool calls are not supported.", where, code="unsupported_parameter")
    content = raw.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            is_text = isinstance(part, dict) and part.get("type") == "text"
            if not is_text or not isinstance(part.get("text"), str):
                raise bad_request(f"`{where}.content` parts must be text parts.", f"{where}.content")
            texts.append(part["text"])
        content = "".join(texts)
    if not isinstance(content, str):
        raise bad_request(f"`{where}.content` must be a string or a list of text parts.", f"{where}.content")
    name = raw.get("name")
    if name is not None and not isinstance(name, str):
        raise bad_request(f"`{where}.name` must be a string.", f"{where}.name")
    return ChatMessage(role, content, name)


def parse_chat_request(body: dict[str, Any], limits: ApiLimits = DEFAULT_LIMITS) -> ApiRequest:
    """/v1/chat/completions: text messages, rendered later with the model's chat template."""
    fields = _common(body, "chat", limits)
    _unsupported(body, "tools", [])
    _unsupported(body, "chat_template")
    _unsupported(body, "chat_template_kwargs", {})
    _unsupported(body, "response_format", {"type": "text"})
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("`messages` must be a non-empty list.", "messages")
    if len(messages) > limits.max_messages:
        raise too_large(f"`messages` has {len(messages)} entries; at most {limits.max_messages}.")
    parsed = tuple(_message(m, i) for i, m in enumerate(messages))
    max_tokens = _int(body, "max_completion_tokens", 1, INT64 - 1)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", 1, INT64 - 1)
    add_generation_prompt = _bool(body, "add_generation_prompt", True)
    continue_final = _bool(body, "continue_final_message", False)
    if add_generation_prompt and continue_final:
        raise bad_request("`continue_final_message` requires `add_generation_prompt` false.",
                          "continue_final_message")
    return ApiRequest(messages=parsed, max_tokens=max_tokens, add_generation_prompt=add_generation_prompt,
                      continue_final_message=continue_final, **_logprobs(body, _chat_logprobs(body)),
                      **fields)


def _logprobs(body: dict[str, Any], logprobs: int | None) -> dict[str, Any]:
    """The logprobs fields of an ApiRequest; vLLM's `return_tokens_as_token_ids` counts only with them (so
    that alone it is a field that changes nothing, and the canonical encoding drops it)."""
    as_ids = _bool(body, "return_tokens_as_token_ids", False)
    return {"logprobs": logprobs, "return_tokens_as_token_ids": as_ids and logprobs is not None}


def _chat_logprobs(body: dict[str, Any]) -> int | None:
    """Chat's `logprobs` (a boolean) and `top_logprobs` (0-20; above 0 only with `logprobs`, as vLLM
    checks) as one number of alternatives, or None."""
    top = _int(body, "top_logprobs", 0, MAX_LOGPROBS)
    if not _bool(body, "logprobs", False):
        if top:
            raise bad_request("`top_logprobs` needs `logprobs` set to true.", "top_logprobs")
        return None
    return top or 0


def message_body(message: ChatMessage) -> dict[str, str]:
    """A chat message as JSON (and as a chat template reads it)."""
    name = {"name": message.name} if message.name is not None else {}
    return {"role": message.role, "content": message.content, **name}


def parse_request(endpoint: Endpoint, raw: bytes, limits: ApiLimits = DEFAULT_LIMITS) -> ApiRequest:
    return parse_request_body(endpoint, parse_json_body(raw, limits), limits)


def parse_request_body(endpoint: Endpoint, body: dict[str, Any],
                       limits: ApiLimits = DEFAULT_LIMITS) -> ApiRequest:
    return parse_chat_request(body, limits) if endpoint == "chat" else parse_completion_request(body, limits)


def _options_body(options: PlanetServeOptions) -> dict[str, Any]:
    body: dict[str, Any] = {}
    if options.session_id is not None:
        body["session_id"] = options.session_id
    if options.hops:
        body["hops"] = options.hops
    if options.no_forward:
        body["no_forward"] = True
    return body


def canonical_body(request: ApiRequest) -> bytes:
    """The request in its one encoding, whatever program wrote it: the fields it carries, in one order,
    in compact JSON, parsed back to the same request. A relay sends this rather than the program's
    bytes, so that key order, spacing, number spelling and fields that change nothing (`user`,
    `metadata`, `n: 1`, unknown extensions) tell no program, and no challenge, from another."""
    body: dict[str, Any] = {"model": request.model} if request.model is not None else {}
    if request.endpoint == "chat":
        body["messages"] = [message_body(m) for m in request.messages]
    else:
        body["prompt"] = list(request.prompt) if isinstance(request.prompt, tuple) else request.prompt
    if request.max_tokens is not None:
        body["max_tokens"] = request.max_tokens
    body["temperature"] = request.temperature
    if request.seed is not None:
        body["seed"] = request.seed
    body["top_p"] = request.top_p
    body["stream"] = request.stream
    if request.stream:
        body["stream_options"] = {"include_usage": request.include_usage,
                                  "continuous_usage_stats": request.continuous_usage}
    if request.stop:
        body["stop"] = list(request.stop)
    if request.stop_token_ids:
        body["stop_token_ids"] = list(request.stop_token_ids)
    if request.ignore_eos:
        body["ignore_eos"] = True
    if request.return_token_ids:
        body["return_token_ids"] = True
    if not request.add_generation_prompt:
        body["add_generation_prompt"] = False
    if request.continue_final_message:
        body["continue_final_message"] = True
    if request.prompt_logprobs is not None:
        body["prompt_logprobs"] = request.prompt_logprobs
    body.update(_logprobs_fields(request))
    if options := _options_body(request.planetserve):
        body["planetserve"] = options
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()


def _logprobs_fields(request: ApiRequest) -> dict[str, Any]:
    if request.logprobs is None:
        return {}
    fields: dict[str, Any] = {"logprobs": request.logprobs} if request.endpoint == "completions" else {
        "logprobs": True, "top_logprobs": request.logprobs}
    if request.return_tokens_as_token_ids:
        fields["return_tokens_as_token_ids"] = True
    return fields


def check_model(request: ApiRequest, served: Iterable[str]) -> str:
    """The served model a request names (or the first one, when it names none, as vLLM does)."""
    names = list(served)
    if request.model is None:
        return names[0]
    if request.model not in names:
        raise model_not_found(request.model)
    return request.model


# -- prompts ----------------------------------------------------------------------------------------


def prompt_text(request: ApiRequest, tokenizer: Tokenizer) -> tuple[str, bool]:
    """A text prompt as the model reads it, and whether tokenising it adds special tokens: a
    completion prompt as given (with special tokens, as vLLM does, unless it begins with BOS:
    `models.prompts`), chat messages rendered with the tokenizer's chat template (which adds its own).
    Model nodes sign responses over this text."""
    if isinstance(request.prompt, str):
        return request.prompt, adds_special_tokens(request.prompt, tokenizer)
    if request.prompt is not None:
        raise bad_request("Send the prompt as text: answers are signed over it.", "prompt",
                          code="text_required")
    if not getattr(tokenizer, "chat_template", None):
        raise bad_request("This model has no chat template; use /v1/completions.", "messages",
                          code="no_chat_template")
    conversation = [message_body(m) for m in request.messages]
    try:
        text = tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
        )
    except Exception as exc:  # the template is model-supplied Jinja and may reject a conversation
        reason = str(exc)[:200]
        raise bad_request(f"The chat template rejected these messages: {reason}", "messages") from None
    return text, False


def render_prompt(request: ApiRequest, tokenizer: Tokenizer, max_chars: int | None = None) -> tuple[int, ...]:
    """The prompt's token ids: given, or tokenised from its text (see prompt_text and tokenize_prompt)."""
    if isinstance(request.prompt, tuple):
        return request.prompt
    text, special = prompt_text(request, tokenizer)
    return tokenize_prompt(text, special, tokenizer, max_chars)


def tokenize_prompt(text: str, special: bool, tokenizer: Tokenizer,
                    max_chars: int | None = None) -> tuple[int, ...]:
    """`text`'s token ids, refused by its length before the tokeniser runs where it has more than
    `max_chars` characters (see max_prompt_chars): tokenising 4 MiB of text held a node's event loop
    for six seconds, only to refuse the prompt afterwards."""
    if max_chars is not None and len(text) > max_chars:
        raise too_large(f"The prompt has {len(text)} characters; no prompt of more than {max_chars} fits "
                        "the tokens this server accepts.", code="prompt_too_long")
    return tuple(tokenizer(text, add_special_tokens=special)["input_ids"])


def max_prompt_chars(tokenizer: Tokenizer, max_tokens: int) -> int | None:
    """The most characters a text of at most `max_tokens` tokens can have: no token stands for more
    characters than its vocabulary entry has (a byte-level entry spells each byte as one character), so
    a longer text needs more tokens. None where the tokenizer does not list its vocabulary. (A tokenizer
    whose normaliser drops characters could fit more; those this project serves do not.)"""
    vocabulary = getattr(tokenizer, "get_vocab", None)
    if vocabulary is None:
        return None
    return max_tokens * max(map(len, vocabulary()), default=1)


def check_prompt_tokens(prompt_ids: Sequence[int], max_tokens: int) -> None:
    """Refuse a prompt of more than `max_tokens` tokens (a server's own bound, below the context)."""
    if len(prompt_ids) > max_tokens:
        raise too_large(f"The prompt has {len(prompt_ids)} tokens; this node accepts at most {max_tokens}.",
                        code="prompt_too_long")


def build_generation(
    request: ApiRequest,
    prompt_ids: Sequence[int],
    *,
    max_model_len: int,
    vocab_size: int,
    eos_token_ids: Iterable[int] = (),
) -> GenerationRequest:
    """The engine request, after the checks that need the model: vocabulary and context length. Every
    request gets a seed (the program's, or a fresh one), and its temperature and top_p in the
    thousandths a node signs, so that what the node signs names exactly how it sampled and anyone
    holding the model can check each token (planetserve.sampling)."""
    if not prompt_ids:
        raise bad_request("The prompt is empty.", "prompt")
    if any(t >= vocab_size for t in prompt_ids):
        raise bad_request(f"Prompt token ids must be below the vocabulary size {vocab_size}.", "prompt")
    if any(t >= vocab_size for t in request.stop_token_ids):
        raise bad_request(f"Stop token ids must be below the vocabulary size {vocab_size}.", "stop_token_ids")
    room = max_model_len - len(prompt_ids)
    if room < 1:
        raise too_large(
            f"This model's maximum context length is {max_model_len} tokens; the prompt has "
            f"{len(prompt_ids)} tokens, leaving no room to generate.", code="context_length_exceeded")
    max_tokens = room if request.max_tokens is None else request.max_tokens
    if max_tokens > room:
        raise too_large(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{len(prompt_ids) + max_tokens} tokens ({len(prompt_ids)} in the prompt, {max_tokens} for "
            f"the completion).", code="context_length_exceeded")
    stops = dict.fromkeys(request.stop_token_ids)
    if not request.ignore_eos:
        stops.update(dict.fromkeys(eos_token_ids))
    seed = secrets.randbits(SEED_BITS) if request.seed is None else to_seed(request.seed)
    return GenerationRequest(tuple(prompt_ids), max_tokens, milli(request.temperature) / MILLI, seed,
                             tuple(stops), logprobs=request.logprobs, top_p=milli(request.top_p) / MILLI)


# -- responses --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ResponseMeta:
    endpoint: Endpoint
    id: str
    created: int
    model: str

    @classmethod
    def new(cls, endpoint: Endpoint, model: str) -> ResponseMeta:
        prefix = "chatcmpl" if endpoint == "chat" else "cmpl"
        return cls(endpoint, f"{prefix}-{uuid.uuid4().hex}", int(time.time()), model)

    def envelope(self, stream: bool) -> dict[str, Any]:
        kind = {("chat", False): "chat.completion", ("chat", True): "chat.completion.chunk"}
        obj = kind.get((self.endpoint, stream), "text_completion")
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}


def usage_body(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def prompt_logprobs_body(scored: Sequence[dict[int, tuple[float, int]] | None],
                         decode: Callable[[int], str]) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs` field: per prompt position, token id (as a string) -> log-probability,
    rank and decoded text; None for the first token."""
    return [None if entry is None else
            {str(t): {"logprob": lp, "rank": rank, "decoded_token": decode(t)}
             for t, (lp, rank) in entry.items()}
            for entry in scored]


def response_body(
    meta: ResponseMeta,
    *,
    text: str,
    finish_reason: str,
    usage: dict[str, Any],
    prompt_token_ids: Sequence[int] | None = None,
    token_ids: Sequence[int] | None = None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A whole (non-streamed) answer; token id lists only when the request asked for them."""
    choice: dict[str, Any] = {"index": 0}
    if meta.endpoint == "chat":
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    choice.update({"logprobs": logprobs, "finish_reason": finish_reason, "stop_reason": None})
    body = {**meta.envelope(False), "choices": [choice], "usage": usage}
    if token_ids is not None:
        choice["token_ids"] = list(token_ids)
    if prompt_token_ids is not None:
        (body if meta.endpoint == "chat" else choice)["prompt_token_ids"] = list(prompt_token_ids)
    return body


def chunk_body(
    meta: ResponseMeta,
    *,
    text: str = "",
    finish_reason: str | None = None,
    first: bool = False,
    token_ids: Sequence[int] | None = None,
    prompt_token_ids: Sequence[int] | None = None,
    usage: dict[str, Any] | None = None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One streamed chunk; chat's first chunk announces the assistant role, its last has an empty delta.
    `logprobs` are those of the chunk's own tokens."""
    choice: dict[str, Any] = {"index": 0}
    if meta.endpoint == "chat":
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text or (first and finish_reason is None):
            delta["content"] = text
        choice["delta"] = delta
    else:
        choice["text"] = text
    choice.update({"logprobs": logprobs, "finish_reason": finish_reason, "stop_reason": None})
    if token_ids is not None:
        choice["token_ids"] = list(token_ids)
    body = {**meta.envelope(True), "choices": [choice], "usage": usage}
    if prompt_token_ids is not None:
        (body if meta.endpoint == "chat" else choice)["prompt_token_ids"] = list(prompt_token_ids)
    return body


def usage_chunk(meta: ResponseMeta, usage: dict[str, Any]) -> dict[str, Any]:
    """The trailing chunk of `stream_options.include_usage`: no choices, only usage."""
    return {**meta.envelope(True), "choices": [], "usage": usage}


def model_body(model: str, *, max_model_len: int | None, created: int | None = None) -> dict[str, Any]:
    """One model object, as vLLM shows it; `max_model_len` (the context length, prompt and completion
    together) only where the server knows it."""
    card = {"id": model, "object": "model", "created": int(time.time()) if created is None else created,
            "owned_by": "planetserve", "root": model, "parent": None}
    return card if max_model_len is None else {**card, "max_model_len": max_model_len}


def models_body(models: Iterable[str], *, max_model_len: int | None,
                created: int | None = None) -> dict[str, Any]:
    stamp = int(time.time()) if created is None else created
    cards = [model_body(m, max_model_len=max_model_len, created=stamp) for m in models]
    return {"object": "list", "data": cards}


# -- generated tokens' log-probabilities ------------------------------------------------------------


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, character -> the byte it stands for."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    chars = [*printable, *range(256, 256 + len(others))]
    return {chr(c): b for c, b in zip(chars, [*printable, *others], strict=True)}


BYTE_LEVEL = _byte_level_alphabet()


class TokenTexts:
    """How a token id reads in a `logprobs` answer: its text (decoded alone with special tokens kept, as
    vLLM shows it; "token_id:N" for `return_tokens_as_token_ids`) and its UTF-8 bytes, exact for a
    byte-level BPE tokenizer, whose tokens may hold part of a character that their text cannot show."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self._byte_level = type(decoder).__name__ == "ByteLevel"
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def entry(self, token: int, as_ids: bool = False) -> tuple[str, list[int]]:
        if as_ids:
            text = f"token_id:{token}"
            return text, list(text.encode())
        if token not in self._cache:
            self._cache[token] = self._read(token)
        return self._cache[token]

    def _read(self, token: int) -> tuple[str, list[int]]:
        text = self._tokenizer.decode([token], skip_special_tokens=False)
        pieces = getattr(self._tokenizer, "convert_ids_to_tokens", None)
        piece = pieces(token) if self._byte_level and pieces is not None else None
        if isinstance(piece, str) and piece and all(c in BYTE_LEVEL for c in piece):
            return text, [BYTE_LEVEL[c] for c in piece]
        return text, list(text.encode())


Scored = Sequence[tuple[int, TokenLogprob]]
"""Generated token ids with their log-probabilities."""


class LogprobsWriter:
    """One answer's `logprobs` objects, for the whole answer or chunk by chunk (completions' `text_offset`,
    each token's offset in the generated text, runs on across chunks)."""

    def __init__(self, endpoint: Endpoint, texts: TokenTexts, as_ids: bool = False) -> None:
        self.endpoint = endpoint
        self._texts = texts
        self._as_ids = as_ids
        self._offset = 0

    def body(self, scored: Scored) -> dict[str, Any] | None:
        """None for no tokens (a chunk that carries none)."""
        if not scored:
            return None
        return self._chat(scored) if self.endpoint == "chat" else self._completion(scored)

    def _entry(self, token: int, logprob: float) -> dict[str, Any]:
        text, raw = self._texts.entry(token, self._as_ids)
        return {"token": text, "logprob": logprob, "bytes": raw}

    def _chat(self, scored: Scored) -> dict[str, Any]:
        """OpenAI's chat shape: per token its entry and the `top_logprobs` likeliest entries."""
        return {"content": [{**self._entry(token, lp.logprob),
                             "top_logprobs": [self._entry(t, v) for t, v in lp.top]} for token, lp in scored]}

    def _completion(self, scored: Scored) -> dict[str, Any]:
        """The legacy shape: per token its text, log-probability, the likeliest tokens' texts with theirs
        (the sampled token's added, as OpenAI does, so up to `logprobs` + 1), and its offset."""
        tokens, offsets, tops = [], [], []
        for token, lp in scored:
            text = self._texts.entry(token, self._as_ids)[0]
            top: dict[str, float] = {}
            for t, v in (*lp.top, (token, lp.logprob)):
                top.setdefault(self._texts.entry(t, self._as_ids)[0], v)
            tokens.append(text)
            offsets.append(self._offset)
            tops.append(top)
            self._offset += len(text)
        return {"tokens": tokens, "token_logprobs": [lp.logprob for _, lp in scored], "top_logprobs": tops,
                "text_offset": offsets}
