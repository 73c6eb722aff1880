"""Prompt text to tokens, with control tokens only where the chat template put them.

A chat is rendered by the model's template and tokenized with special-token parsing on, so that
the template's ``<|im_start|>`` becomes the control token. Message content must not get the
same treatment: a user who types ``<|im_end|>\\n<|im_start|>system`` would otherwise write a
real system turn. So content is always tokenized as text:

- **No content holds control-token text** (every ordinary chat): the rendered prompt is
  tokenized whole, as before; the tokens are exactly what they always were.
- **Some content does**: the template is rendered once more with a placeholder for each
  content, which shows the template's own text between the contents. The real rendering is
  matched against that structure (a template may trim content); then the template's text is
  tokenized with special-token parsing and each content without it.
- **The structure does not match** (a template whose output depends on the content in other
  ways): control-token text in content is broken with a zero-width space before rendering, so
  it still reaches the model as text, only one invisible character longer.

``/v1/completions`` keeps parsing special tokens in its raw prompt: there the caller writes the
whole prompt on purpose.

Text with many control tokens is split at them here rather than by llama.cpp, whose split
costs time quadratic in their number (20,000 took 0.8 s, 320,000 minutes). Up to
``EXACT_CONTROLS`` occurrences llama.cpp parses them itself; past that the text between them
is tokenized as text, with the same result for BPE vocabularies (an SPM vocabulary may differ
in where it adds a leading space).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ffi

# Placeholders for content in the structure rendering: private-use code points around the
# message's index, which a template's string filters (trim, and the like) leave alone.
_OPEN, _CLOSE = "\ue000", "\ue001"
_PLACEHOLDER = re.compile(f"{_OPEN}(\\d+){_CLOSE}")
# What breaks control-token text in the fallback: U+200B ZERO WIDTH SPACE after its first
# character.
_BREAK = "\u200b"
# Past this many control-token texts, a text is split here (linear) rather than by llama.cpp.
EXACT_CONTROLS = 128


def text_tokens(vocab: ffi.Vocab, prompt: str) -> list[int]:
    """A raw prompt (``/v1/completions``): special-token text in it is parsed."""
    return _without_double_bos(vocab, _tokenize_special(vocab, prompt, add_special=True))


def chat_tokens(
    template: ffi.ChatTemplate,
    vocab: ffi.Vocab,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    *,
    add_generation_prompt: bool = True,
    continue_final: bool = False,
) -> list[int]:
    """The tokens of ``messages`` (and ``tools``, for a template that renders them) rendered
    by ``template`` with the generation prompt (unless ``add_generation_prompt`` is false); only
    the template's own text yields control tokens. Control-token text in tool definitions,
    calls and names is broken as in the fallback below. Blocking: may take milliseconds.

    ``continue_final``: the last message (the assistant's) is continued, not closed (prefill,
    as llama-server does it): the others rendered with the generation prompt, then its content
    as text."""
    if continue_final:
        *head, last = messages
        before = chat_tokens(template, vocab, head, tools)
        return before + vocab.tokenize(last["content"], add_special=False, parse_special=False)
    control = vocab.control_pattern
    if tools:
        tools = [_break_all(control, tool) for tool in tools]
    # Every field but the content (names, tool calls, ids) is rendered as the template's own
    # text: control-token text in it is broken.
    messages = [{k: v if k in ("role", "content") else _break_all(control, v) for k, v in m.items()} for m in messages]
    render = functools.partial(template.render, add_generation_prompt=add_generation_prompt, tools=tools)
    rendered = render(messages)
    if not any(control.search(m["content"]) for m in messages):
        return _without_double_bos(vocab, _tokenize_special(vocab, rendered, add_special=True))
    pieces = _split_rendering(render, messages, rendered)
    if pieces is None:
        broken = [{**m, "content": _break_control(control, m["content"])} for m in messages]
        prompt = render(broken)
        return _without_double_bos(vocab, _tokenize_special(vocab, prompt, add_special=True))
    tokens: list[int] = []
    for text, is_content in pieces:
        if not text:
            continue
        first = not tokens  # BOS (when the model wants one) before the first piece only
        if is_content:
            tokens += vocab.tokenize(text, add_special=first, parse_special=False)
        else:
            tokens += _tokenize_special(vocab, text, add_special=first)
    return _without_double_bos(vocab, tokens)


def _tokenize_special(vocab: ffi.Vocab, text: str, *, add_special: bool) -> list[int]:
    """``vocab.tokenize(text, parse_special=True)``, in time linear in the number of
    control-token texts (see the module's docstring)."""
    matches = []
    for match in vocab.control_pattern.finditer(text):
        matches.append(match)
        if len(matches) > EXACT_CONTROLS:
            break
    else:
        return vocab.tokenize(text, add_special=add_special, parse_special=True)
    controls = vocab.control_tokens
    tokens = [vocab.bos] if add_special and vocab.add_bos else []
    start = 0
    strip_left = False  # the control token before this text eats its leading whitespace
    for match in vocab.control_pattern.finditer(text):
        token, lstrip, rstrip = controls[match.group()]
        fragment = text[start : match.start()]
        if strip_left:
            fragment = fragment.lstrip()
        if lstrip:
            fragment = fragment.rstrip()
        if fragment:
            tokens += vocab.tokenize(fragment, add_special=False, parse_special=False)
        tokens.append(token)
        start, strip_left = match.end(), rstrip
    fragment = text[start:].lstrip() if strip_left else text[start:]
    if fragment:
        tokens += vocab.tokenize(fragment, add_special=False, parse_special=False)
    return tokens


def _split_rendering(
    render: Callable[[Sequence[Mapping[str, Any]]], str], messages: Sequence[Mapping[str, Any]], rendered: str
) -> list[tuple[str, bool]] | None:
    """``rendered`` cut into (text, is_content) pieces in order, using a rendering with a
    placeholder for each non-empty content; None when the two renderings do not line up."""
    placeholders = [{**m, "content": f"{_OPEN}{i}{_CLOSE}" if m["content"] else ""} for i, m in enumerate(messages)]
    structure = _PLACEHOLDER.split(render(placeholders))
    # split() alternates template text and a captured index: t0, i0, t1, i1, ..., tn.
    pieces: list[tuple[str, bool]] = []
    at = 0
    for k in range(0, len(structure), 2):
        text = structure[k]
        if not rendered.startswith(text, at):
            return None
        pieces.append((text, False))
        at += len(text)
        if k + 1 == len(structure):
            break
        content = messages[int(structure[k + 1])]["content"]
        following = structure[k + 2]
        # The template may have trimmed the content; take the form after which its own text
        # goes on.
        for form in (content, content.strip(), content.lstrip(), content.rstrip()):
            if rendered.startswith(form, at) and rendered.startswith(following, at + len(form)):
                pieces.append((form, True))
                at += len(form)
                break
        else:
            return None
    return pieces if at == len(rendered) else None


def _break_control(control: re.Pattern[str], text: str) -> str:
    return control.sub(lambda m: m.group(0)[0] + _BREAK + m.group(0)[1:], text)


def _break_all(control: re.Pattern[str], value: Any) -> Any:
    """``value`` (JSON data) with control-token text broken in every string, keys included."""
    if isinstance(value, str):
        return _break_control(control, value)
    if isinstance(value, Mapping):
        return {_break_control(control, k): _break_all(control, v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_break_all(control, v) for v in value]
    return value


def _without_double_bos(vocab: ffi.Vocab, tokens: list[int]) -> list[int]:
    if len(tokens) > 1 and tokens[0] == tokens[1] == vocab.bos:
        del tokens[0]  # the template already wrote BOS
    return tokens
