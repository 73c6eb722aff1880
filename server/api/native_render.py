"""llama-server's own answers to a completion (``/completion``, ``/infill``): the final object
(``content``, ``stop_type``, ``timings``, ``generation_settings``, ...), the streamed partial
objects, and ``completion_probabilities``. Pure: values in, JSON-ready dicts out.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from server.api.native_schema import NativeOptions
from server.engine import TokenLogprob, Usage

TokenBytes = Callable[[int], bytes]
LOWEST_LOGPROB = -3.4028234663852886e38  # llama-server's stand-in for log(0): JSON has no -inf
NO_SLOT = -1  # which sequence ran a job is the engine's business unless the request named one


@dataclass(frozen=True)
class Timing:
    """When a job's pieces came, in seconds since the request arrived (``Trace``)."""

    first: float | None  # the first piece: the prompt was done
    last: float | None


def timings(usage: Usage | None, timing: Timing, n_generated: int) -> dict[str, Any]:
    """llama-server's ``timings``: prompt tokens computed (and cached), generated tokens, and
    how long each took. The prompt's time runs to the first piece (queueing included); the first
    token comes with the prompt's last step, so the generation rate is over the others."""
    cached = usage.cached_tokens if usage else 0
    prompt_n = (usage.prompt_tokens - cached) if usage else 0
    predicted_n = usage.completion_tokens if usage else n_generated
    prompt_ms = (timing.first or 0.0) * 1000
    predicted_ms = ((timing.last or 0.0) - (timing.first or 0.0)) * 1000
    return {
        "cache_n": cached,
        "prompt_n": prompt_n,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
        "prompt_per_second": 1000 * prompt_n / prompt_ms if prompt_ms > 0 else 0.0,
        "predicted_n": predicted_n,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_ms / (predicted_n - 1) if predicted_n > 1 else 0.0,
        "predicted_per_second": 1000 * (predicted_n - 1) / predicted_ms
        if predicted_ms > 0 and predicted_n > 1
        else 0.0,
    }


@dataclass(frozen=True)
class Settings:
    """The sampling a job ran with, as ``generation_settings`` reports it."""

    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int
    repeat_penalty: float
    frequency_penalty: float
    presence_penalty: float
    n_predict: int
    stop: Sequence[str]
    n_probs: int
    stream: bool
    timings_per_token: bool
    ignore_eos: bool = False


def generation_settings(s: Settings) -> dict[str, Any]:
    """llama-server's ``generation_settings``: what we sample with, and its other samplers at
    the values that switch them off (they are off here)."""
    return {
        "seed": s.seed,
        "temperature": s.temperature,
        "dynatemp_range": 0.0,
        "dynatemp_exponent": 1.0,
        "top_k": s.top_k,
        "top_p": s.top_p,
        "min_p": s.min_p,
        "top_n_sigma": -1.0,
        "xtc_probability": 0.0,
        "xtc_threshold": 0.1,
        "typical_p": 1.0,
        "repeat_last_n": 64,
        "repeat_penalty": s.repeat_penalty,
        "presence_penalty": s.presence_penalty,
        "frequency_penalty": s.frequency_penalty,
        "dry_multiplier": 0.0,
        "mirostat": 0,
        "adaptive_target": -1.0,
        "adaptive_decay": 0.9,
        "max_tokens": s.n_predict,
        "n_predict": s.n_predict,
        "n_keep": 0,
        "n_discard": 0,
        "ignore_eos": s.ignore_eos,
        "stream": s.stream,
        "n_probs": s.n_probs,
        "min_keep": 0,
        "stop": list(s.stop),
        "samplers": ["penalties", "top_k", "top_p", "min_p", "temperature"],
        "timings_per_token": s.timings_per_token,
        "post_sampling_probs": False,
        "backend_sampling": False,
        "lora": [],
    }


def stop_reason(finish: str, content: str, generated: str, stops: Sequence[str]) -> tuple[str, str]:
    """``stop_type`` and ``stopping_word``: "limit" (``n_predict`` or the context), "word" (a
    stop string, which ``generated``, the text of every generated token, has right after
    ``content``), "eos" (an end-of-generation token or a grammar's end), "none" (cut short)."""
    if finish == "length":
        return "limit", ""
    if finish != "stop":
        return "none", ""
    rest = generated[len(content) :] if generated.startswith(content) else ""
    for stop in stops:
        if rest.startswith(stop):
            return "word", stop
    return "eos", ""


def probabilities(items: Sequence[TokenLogprob], token_bytes: TokenBytes) -> list[dict[str, Any]]:
    """``completion_probabilities``: each generated token with its log-probability and the
    likeliest alternatives there (``top_logprobs``)."""
    return [
        {**_entry(item.token, item.logprob, token_bytes), "top_logprobs": _top(item, token_bytes)} for item in items
    ]


def _top(item: TokenLogprob, token_bytes: TokenBytes) -> list[dict[str, Any]]:
    return [_entry(token, logprob, token_bytes) for token, logprob in item.top if math.isfinite(logprob)]


def _entry(token: int, logprob: float, token_bytes: TokenBytes) -> dict[str, Any]:
    data = token_bytes(token)
    return {
        "id": token,
        "token": data.decode("utf-8", "ignore"),
        "bytes": list(data),
        "logprob": logprob if math.isfinite(logprob) else LOWEST_LOGPROB,
    }


def pick_fields(payload: dict[str, Any], fields: Sequence[str]) -> dict[str, Any]:
    """``response_fields``: only these fields, a ``a/b`` path brought up to the top under its
    path; fields that are not there are left out, without error."""
    out: dict[str, Any] = {}
    for path in fields:
        value: Any = payload
        for part in path.split("/"):
            if not isinstance(value, dict) or part not in value:
                break
            value = value[part]
        else:
            out[path] = value
    return out


@dataclass(frozen=True)
class Final:
    """One choice's whole answer, as the final object reports it."""

    index: int
    content: str
    tokens: Sequence[int]
    finish: str
    usage: Usage | None
    generated: str  # the text of every generated token (stop string included)
    prompt: str  # the prompt's text, special tokens written out
    probabilities: list[dict[str, Any]] | None  # None: not asked for
    id_slot: int = NO_SLOT  # the sequence it ran in, when the request named one


def final_object(
    final: Final, *, model: str, settings: Settings, options: NativeOptions, timing: Timing, stream: bool
) -> dict[str, Any]:
    """llama-server's last object of a completion: whole (``stream`` false), or the stream's
    closing one, whose content and tokens the partial objects already carried."""
    stop_type, stopping_word = stop_reason(final.finish, final.content, final.generated, options.stop)
    usage = final.usage
    n_generated = usage.completion_tokens if usage else len(final.tokens)
    n_prompt = usage.prompt_tokens if usage else 0
    payload: dict[str, Any] = {
        "index": final.index,
        "content": "" if stream else final.content,
        "tokens": [] if stream or not options.return_tokens else list(final.tokens),
        "id_slot": final.id_slot,
        "stop": True,
        "model": model,
        "tokens_predicted": n_generated,
        "tokens_evaluated": n_prompt,
        "generation_settings": generation_settings(settings),
        "prompt": final.prompt,
        "has_new_line": "\n" in final.content,
        "truncated": False,  # a prompt too long for the context is refused, never cut
        "stop_type": stop_type,
        "stopping_word": stopping_word,
        "tokens_cached": n_prompt + n_generated,
        "timings": timings(usage, timing, n_generated),
    }
    if final.probabilities is not None and not stream:
        payload["completion_probabilities"] = final.probabilities
    return pick_fields(payload, options.response_fields) if options.response_fields else payload


def partial_object(
    index: int,
    text: str,
    tokens: Sequence[int],
    *,
    n_generated: int,
    n_prompt: int,
    probs: list[dict[str, Any]] | None,
    timing: dict[str, Any] | None,
    id_slot: int = NO_SLOT,
) -> dict[str, Any]:
    """One streamed piece: its text and tokens, counts so far, and when asked its tokens'
    probabilities and the timings so far (``timings_per_token``)."""
    payload: dict[str, Any] = {
        "index": index,
        "content": text,
        "tokens": list(tokens),
        "stop": False,
        "id_slot": id_slot,
        "tokens_predicted": n_generated,
        "tokens_evaluated": n_prompt,
    }
    if timing is not None:
        payload["timings"] = timing
    if probs:
        payload["completion_probabilities"] = probs
    return payload
