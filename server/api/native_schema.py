"""llama-server's own request bodies (``/completion``, ``/infill``, ``/tokenize``,
``/detokenize``), parsed into the internal request (``schema.CompletionRequest``) or checked
values. Pure: no engine, no framework.

llama-server takes many sampler fields we do not have (typical-p, XTC, DRY, Mirostat, dynamic
temperature, ...). Such a field is accepted only at the value that switches its sampler off
(``OFF_VALUES``), where it changes nothing; the fields that only tune a sampler that is off are
accepted with it (``TUNES``); a few change nothing here at any value (``NO_EFFECT``). Anything
else is refused with a 400 naming it, never accepted and dropped.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from server.api.lazy import deferred
from server.engine.prompt_cache import UNSHARED

if TYPE_CHECKING:
    from server.api import schema
else:  # imported once the server is ready (server.api.lazy)
    schema = deferred("server.api.schema")


# Sampling defaults where a request sets none: llama-server's, so that its clients get the
# answers they expect (the OpenAI routes keep OpenAI's).
NATIVE_TEMPERATURE = 0.8
NATIVE_TOP_K = 40
NATIVE_TOP_P = 0.95
NATIVE_MIN_P = 0.05
MAX_N_PROBS = 20
FLT_MAX = 3.4028234663852886e38  # C's largest float
LLAMA_DEFAULT_SEED = 0xFFFFFFFF  # llama.cpp's "draw a random seed"
MAX_FIELD_NAME = 64  # an unknown field's name, as echoed back in an error (as preflight's)
# llama.cpp's default sampler order, which is ours (penalties, top-k, top-p, min-p, temperature;
# the others off): as names, and as its one-letter form.
DEFAULT_SAMPLERS = ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature")
DEFAULT_SAMPLER_CHARS = "edskypmxt"


def _off(value: Any, test: Callable[[Any], bool]) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and test(value)


# field -> does this value leave its sampler (or feature) off?
OFF_VALUES: dict[str, Callable[[Any], bool]] = {
    "typical_p": lambda v: _off(v, lambda x: x >= 1.0),
    "xtc_probability": lambda v: _off(v, lambda x: x <= 0.0),
    "dynatemp_range": lambda v: _off(v, lambda x: x <= 0.0),
    "mirostat": lambda v: _off(v, lambda x: x == 0),
    "dry_multiplier": lambda v: _off(v, lambda x: x <= 0.0),
    "top_n_sigma": lambda v: _off(v, lambda x: x <= 0.0),
    "adaptive_target": lambda v: _off(v, lambda x: x < 0.0),
    "n_cache_reuse": lambda v: _off(v, lambda x: x == 0),
    "t_max_predict_ms": lambda v: _off(v, lambda x: x <= 0),
    "n_indent": lambda v: _off(v, lambda x: x == 0),
    "min_keep": lambda v: _off(v, lambda x: x in (0, 1)),  # ours keeps one token, as 0 does there
    "backend_sampling": lambda v: v is False,
    "return_progress": lambda v: v is False,
    "post_sampling_probs": lambda v: v is False,
    "grammar_lazy": lambda v: v is False,
    "verbose": lambda v: v is False,
    "lora": lambda v: v == [],
}
# field -> the field that must be off for it to change nothing
TUNES = {
    "xtc_threshold": "xtc_probability",
    "dynatemp_exponent": "dynatemp_range",
    "mirostat_tau": "mirostat",
    "mirostat_eta": "mirostat",
    "dry_base": "dry_multiplier",
    "dry_allowed_length": "dry_multiplier",
    "dry_penalty_last_n": "dry_multiplier",
    "dry_sequence_breakers": "dry_multiplier",
    "adaptive_decay": "adaptive_target",
}
# Fields that change no answer here: n_keep/n_discard only matter when a context shifts, which
# ours never does; pings and the native stream's lack of a usage chunk are the same whatever
# these say. (cache_prompt does: a prompt whose cached prefix is reused computes its last tokens
# in a smaller batch, and llama.cpp's sums round otherwise, so a greedy answer may differ.)
NO_EFFECT = frozenset({"n_keep", "n_discard", "sse_ping_interval", "stream_options", "model"})


class NativeError(ValueError):
    """A problem with a native request body: a 400 naming ``param``."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class NativeOptions:
    """What the native answer reports beside the text (its own fields, not the engine's)."""

    return_tokens: bool = False
    n_probs: int = 0
    timings_per_token: bool = False
    response_fields: tuple[str, ...] = ()
    stop: tuple[str, ...] = ()
    n_predict: int = -1
    seed: int = LLAMA_DEFAULT_SEED
    ignore_eos: bool = False


@dataclass(frozen=True)
class Defaults:
    """The server's own defaults for what a request leaves out (``--temp``, ``--seed``)."""

    temperature: float | None = None  # None: llama-server's 0.8
    seed: int | None = None  # None: a fresh one per request


def unsupported(name: str) -> NativeError:
    """The error for a field this server does not do, naming it (a long name cut short)."""
    name = name[:MAX_FIELD_NAME]
    return NativeError(f"{name!r} is not supported by this server", name)


def refuse_unknown(body: dict[str, Any], known: frozenset[str]) -> None:
    """A route with a few fields of its own (``/tokenize``, ``/detokenize``, ``/embedding``):
    ``unsupported`` for the first other field of ``body`` that is set (null sets nothing),
    never accepted and dropped."""
    for name, value in body.items():
        if value is not None and name not in known:
            raise unsupported(name)


def refused_field(body: dict[str, Any], known: frozenset[str]) -> str | None:
    """The first field of ``body`` set to something this server does not do, or None."""
    for name, value in body.items():
        if name in known or name in NO_EFFECT or value is None:
            continue
        off = OFF_VALUES.get(name)
        if off is not None:
            if not off(value):
                return name
            continue
        parent = TUNES.get(name)
        if parent is not None:
            if not OFF_VALUES[parent](body.get(parent, _DEFAULT_OFF[parent])):
                return name
            continue
        if name == "samplers" and not _default_samplers(value):
            return name
        if name == "samplers":
            continue
        if name == "repeat_last_n" and value != 64 and not _no_penalties(body):
            return name
        if name == "repeat_last_n":
            continue
        return name
    return None


# Each sampler's default in llama-server, which is off.
_DEFAULT_OFF: dict[str, Any] = {
    "xtc_probability": 0.0,
    "dynatemp_range": 0.0,
    "mirostat": 0,
    "dry_multiplier": 0.0,
    "adaptive_target": -1.0,
}


def _default_samplers(value: Any) -> bool:
    """Whether ``samplers`` names llama-server's default chain; ``NativeError`` when it is not
    a string or a list of strings."""
    if isinstance(value, str):
        return value == DEFAULT_SAMPLER_CHARS
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise NativeError("samplers must be a string of sampler letters or a list of sampler names", "samplers")
    names = [{"typical_p": "typ_p", "top-k": "top_k", "top-p": "top_p", "min-p": "min_p"}.get(v, v) for v in value]
    return names == list(DEFAULT_SAMPLERS)


def _no_penalties(body: dict[str, Any]) -> bool:
    return (
        body.get("repeat_penalty") in (None, 1.0)
        and body.get("frequency_penalty") in (None, 0.0)
        and body.get("presence_penalty") in (None, 0.0)
    )


# Fields of /completion this module reads itself.
COMPLETION_FIELDS = frozenset(
    {
        "prompt",
        "n_predict",
        "max_tokens",
        "max_completion_tokens",
        "stream",
        "return_tokens",
        "n_probs",
        "logprobs",
        "timings_per_token",
        "response_fields",
        "temperature",
        "top_k",
        "top_p",
        "min_p",
        "seed",
        "repeat_penalty",
        "frequency_penalty",
        "presence_penalty",
        "logit_bias",
        "ignore_eos",
        "stop",
        "n",
        "n_cmpl",
        "json_schema",
        "grammar",
        "cache_salt",
        "cache_prompt",
        "id_slot",
    }
)


def _number(
    body: dict[str, Any], name: str, low: float, high: float, default: Any = None, *, integer: bool = False
) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or (integer and not isinstance(value, int)):
        raise NativeError(f"{name} must be {'an integer' if integer else 'a number'}", name)
    if isinstance(value, float) and not math.isfinite(value):
        raise NativeError(f"{name} must be finite", name)
    if not low <= value <= high:
        raise NativeError(f"{name} must be between {low} and {high}, got {value}", name)
    return value


def _or(value: float | None, default: float) -> float:
    return default if value is None else value


def _clamped(body: dict[str, Any], name: str, low: float, high: float, default: float, *, integer: bool = False) -> Any:
    value = _number(body, name, -math.inf, math.inf, default, integer=integer)
    return min(max(value, low), high)


def _flag(body: dict[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise NativeError(f"{name} must be true or false", name)
    return value


class Tokenizer(Protocol):
    """What parsing needs of the vocabulary (``ffi.Vocab`` is one)."""

    @property
    def n_tokens(self) -> int: ...

    @property
    def eog_tokens(self) -> frozenset[int]: ...

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]: ...


def completion_request(
    body: dict[str, Any], prompts: list[list[int]], vocab: Tokenizer, defaults: Defaults = Defaults()
) -> tuple[schema.CompletionRequest, NativeOptions]:
    """A native completion body as the internal request (prompts already as tokens) and what
    the native answer reports besides. Blocking when ``logit_bias`` names token text (it is
    tokenized). Raises ``NativeError``."""
    refused = refused_field(body, COMPLETION_FIELDS)
    if refused is not None:
        raise unsupported(refused)
    n_predict = body.get("n_predict", body.get("max_tokens", body.get("max_completion_tokens")))
    n_predict = _number({"n_predict": n_predict}, "n_predict", -1, 2**31 - 1, -1, integer=True)
    if n_predict == 0:
        raise NativeError("n_predict 0 (only fill the cache) is not supported; ask for 1 or more", "n_predict")
    n_probs = _number(body, "n_probs", 0, MAX_N_PROBS, None, integer=True)
    if n_probs is None:
        n_probs = _number(body, "logprobs", 0, MAX_N_PROBS, 0, integer=True)
    seed = _number(body, "seed", -1, 2**64 - 1, -1, integer=True)
    if seed in (-1, LLAMA_DEFAULT_SEED) and defaults.seed is not None:
        seed = defaults.seed
    stop = body.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise NativeError("stop must be a string or a list of strings", "stop")
    stop = [s for s in stop if s]
    if len(stop) > schema.MAX_STOP_STRINGS:
        raise NativeError(f"at most {schema.MAX_STOP_STRINGS} stop strings, got {len(stop)}", "stop")
    salt = cache_salt(body)
    if body.get("cache_prompt") is not None and not _flag(body, "cache_prompt"):
        # Computed whole, as llama-server does: a scope no other request shares, whose cells the
        # host cache does not keep (prompt_cache.UNSHARED).
        salt = f"{salt or ''}{UNSHARED}{secrets.token_hex(8)}"
    fields = body.get("response_fields") or []
    if not isinstance(fields, list) or not all(isinstance(f, str) for f in fields):
        raise NativeError("response_fields must be a list of strings", "response_fields")
    n = _number(body, "n_cmpl", 1, 64, None, integer=True) or _number(body, "n", 1, 64, 1, integer=True)
    internal: dict[str, Any] = {
        "prompt": prompts[0] if len(prompts) == 1 else prompts,
        "stream": _flag(body, "stream"),
        "max_tokens": None if n_predict < 0 else n_predict,
        # Out of range: brought into it, as llama-server does for these (its temperature is any
        # float from 0 up; the sampler takes a float, so the largest float, not infinity).
        "temperature": _clamped(body, "temperature", 0.0, FLT_MAX, _or(defaults.temperature, NATIVE_TEMPERATURE)),
        "top_k": int(_clamped(body, "top_k", 0, 2**31 - 1, NATIVE_TOP_K, integer=True)),
        "top_p": _clamped(body, "top_p", 0.0, 1.0, NATIVE_TOP_P),
        "min_p": _clamped(body, "min_p", 0.0, 1.0, NATIVE_MIN_P),
        "seed": None if seed == -1 or seed == LLAMA_DEFAULT_SEED else seed,
        "repeat_penalty": _number(body, "repeat_penalty", 0.0, 10.0, None) or None,
        "frequency_penalty": _number(body, "frequency_penalty", -2.0, 2.0, None),
        "presence_penalty": _number(body, "presence_penalty", -2.0, 2.0, None),
        "logit_bias": logit_bias(body.get("logit_bias"), vocab, ignore_eos=_flag(body, "ignore_eos")),
        "stop": stop or None,
        "n": n,
        "logprobs": n_probs if n_probs else None,
        "json_schema": _json_schema(body),
        "grammar": _grammar(body),
        "cache_salt": salt,
        "id_slot": _number(body, "id_slot", -1, 2**31 - 1, None, integer=True),
    }
    req = schema.CompletionRequest.model_construct(**internal)
    options = NativeOptions(
        return_tokens=_flag(body, "return_tokens"),
        n_probs=n_probs,
        timings_per_token=_flag(body, "timings_per_token"),
        response_fields=tuple(fields),
        stop=tuple(stop),
        n_predict=n_predict,
        seed=LLAMA_DEFAULT_SEED if internal["seed"] is None else internal["seed"],
        ignore_eos=_flag(body, "ignore_eos"),
    )
    return req, options


def cache_salt(body: dict[str, Any]) -> str | None:
    """``body``'s ``cache_salt`` (a scope of its own within the tenant), checked as on the
    OpenAI routes."""
    salt = body.get("cache_salt")
    if salt is not None and not (isinstance(salt, str) and 0 < len(salt) <= schema.MAX_CACHE_SALT):
        raise NativeError(f"cache_salt must be a string of 1 to {schema.MAX_CACHE_SALT} characters", "cache_salt")
    return salt


def _json_schema(body: dict[str, Any]) -> dict[str, Any] | None:
    value = body.get("json_schema")
    if value is None:
        return None
    if body.get("grammar"):  # llama-server lets the grammar win silently; one is dropped either way
        raise NativeError("give json_schema or grammar, not both", "json_schema")
    if not isinstance(value, dict):
        raise NativeError("json_schema must be a JSON Schema object", "json_schema")
    return value or {"type": "object"}  # an empty schema: any object, as there


def _grammar(body: dict[str, Any]) -> str | None:
    value = body.get("grammar")
    if value is None or value == "":
        return None
    if not isinstance(value, str) or len(value) > schema.MAX_GRAMMAR_CHARS:
        raise NativeError(f"grammar must be a GBNF string of at most {schema.MAX_GRAMMAR_CHARS} characters", "grammar")
    return value


BAN = float("-inf")  # a bias of false: the token is never picked


# More digits than any token id has (int() refuses over 4300): outside the vocabulary, skipped.
_MAX_ID_DIGITS = 12
_C_SPACE = " \t\n\v\f\r"  # C's isspace() (the "C" locale), which strtol skips first


def logit_bias(value: Any, vocab: Tokenizer, *, ignore_eos: bool = False) -> dict[str, float] | None:
    """llama-server's ``logit_bias`` (a bias of ``false`` bans) as token id -> bias, the biases
    of a token named more than once (or whose text has it twice) added up; read as there: in
    ``[[token, bias], ...]`` an integer is a token id and a string text (digits too), whose
    tokens all get the bias; in ``{"token": bias}`` a key is a token id when it is a
    number as C's ``strtol`` reads it (``key_id``), and text otherwise. ``ignore_eos`` bans the
    end-of-generation tokens. Ids outside the vocabulary (a negative one too) are skipped, as
    there."""
    if value is None:
        items: list[Any] = []
    elif isinstance(value, list):
        items = value
    elif isinstance(value, dict):
        items = [[k, v] for k, v in value.items()]
    else:
        raise NativeError("logit_bias must be a list of [token, bias] pairs or an object", "logit_bias")
    if len(items) > schema.MAX_LOGIT_BIAS:
        raise NativeError(f"at most {schema.MAX_LOGIT_BIAS} logit_bias entries, got {len(items)}", "logit_bias")
    out: dict[str, float] = {}
    for i, item in enumerate(items):
        if not isinstance(item, list) or len(item) != 2:
            raise NativeError("each logit_bias entry must be a [token, bias] pair", f"logit_bias[{i}]")
        token, bias = item
        if isinstance(value, dict):
            named = key_id(token)
            token = token if named is None else named
        if bias is False:
            bias = BAN
        elif isinstance(bias, bool) or not isinstance(bias, int | float) or not math.isfinite(bias):
            raise NativeError("a logit_bias bias must be a number or false", f"logit_bias[{i}]")
        if isinstance(token, str):
            tokens = vocab.tokenize(token, add_special=False, parse_special=False)
        elif isinstance(token, int) and not isinstance(token, bool):
            tokens = [token]
        else:
            raise NativeError("a logit_bias token must be an id or text", f"logit_bias[{i}]")
        for t in tokens:
            if 0 <= t < vocab.n_tokens:  # each entry adds to the token's bias (llama.cpp's sampler)
                total = out.get(str(t), 0.0) + float(bias)
                out[str(t)] = BAN if math.isnan(total) else total  # a ban beside an infinite bias: banned
    if ignore_eos:
        out.update({str(t): BAN for t in vocab.eog_tokens})
    return out or None


def key_id(key: str) -> int | None:
    """The token id an object-form ``logit_bias`` key names, or None when the key is text:
    llama-server's test, ``strtol(key, &end, 10)`` and ``*end == 0``. So C white space, then an
    optional sign, then ASCII digits to the end (the key read as C reads it: up to a NUL);
    an empty key is 0 (strtol reads nothing, and stops at the end). An id of more digits than
    any vocabulary has is -1 (skipped, as there: strtol's overflow comes out negative or
    wrapped; ours never wraps into the vocabulary)."""
    text = key.split("\0", 1)[0]
    if not text:
        return 0
    number = text.lstrip(_C_SPACE)
    negative = number[:1] == "-"
    if number[:1] in ("+", "-"):
        number = number[1:]
    if not number or not number.isascii() or not number.isdigit():
        return None
    digits = number.lstrip("0") or "0"
    if len(digits) > _MAX_ID_DIGITS:
        return -1
    return -int(digits) if negative else int(digits)
