"""Log-probabilities in OpenAI's legacy shape, pure (a small vocabulary of our own): every
alternative keeps a key of its own, and every token its own ``text_offset``."""

from __future__ import annotations

from server.api.logprobs import CompletionLogprobs, completion_whole, legacy_name
from server.engine import TokenLogprob

# token -> (bytes in generated text, the vocabulary's spelling)
VOCAB = {
    0: (b"", "<|endoftext|>"),  # control tokens have no text of their own
    1: (b"", "<|im_end|>"),
    2: (b" six", "Ġsix"),
    3: (b",", ","),
    4: (b"\xf0\x9f", "<0xF0><0x9F>"),  # the first half of an emoji
    5: (b"\x98\x80", "<0x98><0x80>"),  # its second half: together U+1F600
    6: (b"\xe2\x80", "<0xE2><0x80>"),  # the start of another character
    7: (b" ok", "Ġok"),
    8: (b"<|im_end|>", "<|im_end|>"),  # ordinary text that spells a control token
}


class Vocab:
    def piece(self, token: int) -> bytes:
        return VOCAB[token][0]

    def text(self, token: int) -> str:
        return VOCAB[token][1]


def lp(token: int, *top: tuple[int, float]) -> TokenLogprob:
    return TokenLogprob(token, dict(top).get(token, -1.0), tuple(top))


def test_names_are_distinct_for_distinct_tokens() -> None:
    vocab = Vocab()
    names = [legacy_name(t, vocab) for t in VOCAB]
    assert names[:4] == ["<|endoftext|>", "<|im_end|>", " six", ","]
    assert names[4:7] == ["bytes:\\xf0\\x9f", "bytes:\\x98\\x80", "bytes:\\xe2\\x80"]  # as OpenAI writes them


def test_every_alternative_keeps_its_own_key() -> None:
    # Three partial characters (all "\ufffd" when decoded on their own, before: one key, the
    # last and lowest value), two control tokens (both "" before), and text that spells one.
    item = lp(4, (4, -0.1), (6, -0.2), (5, -0.3), (1, -0.4), (0, -0.5), (8, -0.6))
    top = completion_whole([item], Vocab())["top_logprobs"][0]
    assert len(top) == 6
    assert top["bytes:\\xf0\\x9f"] == -0.1 and top["bytes:\\xe2\\x80"] == -0.2
    assert top["<|im_end|>"] == -0.4 and top["<|endoftext|>"] == -0.5
    assert top["token:8"] == -0.6  # its name is taken: its id instead


def test_the_chosen_tokens_name_is_its_own() -> None:
    # Token 8's text is the name control token 1 goes by; chosen, token 8 keeps it.
    out = completion_whole([lp(8, (1, -0.5), (8, -0.7))], Vocab())
    assert out["tokens"] == ["<|im_end|>"]
    assert out["top_logprobs"][0] == {"<|im_end|>": -0.7, "token:1": -0.5}


def test_each_token_has_its_own_offset() -> None:
    reader = CompletionLogprobs(Vocab())
    # " six" held back by a partial stop-string match (a piece without text), then "," releases
    # both (before: both at 0, where holding began).
    offsets = reader.payload([lp(2)])["text_offset"] + reader.payload([lp(3)])["text_offset"]
    assert offsets == [0, 4]
    # An emoji in two tokens: both at its place, the next token after it (one character).
    assert reader.payload([lp(4), lp(5)])["text_offset"] == [5, 5]
    assert reader.payload([lp(7)])["text_offset"] == [6]
    # A control token has no text: the next token is at the same place.
    assert reader.payload([lp(1), lp(3)])["text_offset"] == [9, 9]
