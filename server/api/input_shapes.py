"""What OpenAI's completions take as ``prompt`` and its embeddings as ``input``: a string,
strings, token ids, or lists of token ids, as a pydantic type (``texts_or_tokens``), part of
the wire schema (``schema``). Pure: pydantic only.

The shape a value is meant as is read from its first item, and only that shape validates it:
a refusal then says what is wrong with the value (more items than allowed, an empty list, an
empty token list, a negative id), where trying each shape in turn reported the first one's
complaint ("Input should be a valid string") whatever was wrong.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Discriminator, Field, Tag

TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]
SHAPE_MESSAGE = "Input should be a string, strings, token ids or lists of token ids"


def texts_or_tokens(most: int) -> Any:
    """A string, strings, token ids, or lists of token ids (at most ``most`` strings or
    lists); another value is an error with ``SHAPE_MESSAGE``. Each shape's tag is in an
    error's location; none is an identifier, so ``errors.param_from_loc`` leaves it out of the
    field path (``input[1]``, not ``input.list[int][1]``)."""
    return Annotated[
        Annotated[str, Tag("str")]
        | Annotated[list[str], Field(min_length=1, max_length=most), Tag("list[str]")]
        | Annotated[list[TokenId], Field(min_length=1), Tag("list[int]")]
        | Annotated[
            list[Annotated[list[TokenId], Field(min_length=1)]],
            Field(min_length=1, max_length=most),
            Tag("list[list[int]]"),
        ],
        Discriminator(shape_of, custom_error_type="invalid_input", custom_error_message=SHAPE_MESSAGE),
    ]


def shape_of(value: Any) -> str | None:
    """The tag of the shape ``value`` is meant as, by its first item (an empty list: strings,
    whose refusal says that it is empty); None when it is none of them."""
    if isinstance(value, str):
        return "str"
    if not isinstance(value, list):
        return None
    first = value[0] if value else ""
    if isinstance(first, str):
        return "list[str]"
    if isinstance(first, list):
        return "list[list[int]]"
    return "list[int]"  # an id, or what the refusal of an id names
