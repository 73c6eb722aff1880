"""GBNF as llama.cpp's parser (vendor/llama.cpp/src/llama-grammar.cpp) reads it, translated to
llguidance's Lark (``server.engine.gbnf``): each form compiled by llguidance and its matcher run
over sample texts a byte at a time, the texts llama.cpp's grammar takes and those it refuses.
No model: the matcher's tokenizer has one token per byte."""

from __future__ import annotations

from collections.abc import Callable

import llguidance
import pytest

from server.engine.gbnf import GbnfError, to_lark
from server.engine.grammar import GrammarCache, GrammarError
from server.engine.grammar_limits import parser_limits


class _ByteTokens:
    """Token i is byte i; 256 is the end."""

    def __init__(self) -> None:
        self.eos_token_id = 256
        self.bos_token_id = None
        self.tokens = [bytes([i]) for i in range(256)] + [b"\xff<end>"]
        self.special_token_ids = [256]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


BYTES = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTokens()))


def language(gbnf: str) -> Callable[[str], bool]:
    """Whether a text is in the language of ``gbnf`` translated, as the server's matcher says."""
    grammar = llguidance.LLMatcher.grammar_from_lark(to_lark(gbnf))
    start = llguidance.LLMatcher(BYTES, grammar, log_level=0, limits=parser_limits())
    assert not start.is_error(), start.get_error()

    def matches(text: str) -> bool:
        matcher = start.deep_copy()
        return all(matcher.consume_token(byte) for byte in text.encode()) and matcher.is_accepting()

    return matches


# (grammar, texts llama.cpp takes, texts it refuses)
FORMS: dict[str, tuple[str, list[str], list[str]]] = {
    # The reviewer's forms: a quantifier over a group whose content is itself quantified.
    "plus-under-star": ('root ::= ("a"+)* "b"', ["b", "ab", "aaab"], ["", "a", "ba", "abb"]),
    "optional-under-plus": ('root ::= ("x"?)+', ["", "x", "xxx"], ["y", "xy"]),
    "count-under-optional": ('root ::= (("a"){2})?', ["", "aa"], ["a", "aaa"]),
    "count-under-plus": ('root ::= ("a"{2})+', ["aa", "aaaa", "aaaaaa"], ["", "a", "aaa"]),
    "plus-under-count": ('root ::= (("a")+){2}', ["aa", "aaa", "aaaaa"], ["", "a", "b"]),
    "count-under-count": ('root ::= ("ab"{2}){3}', ["ab" * 6], ["ab" * 5, "ab" * 7, "abab"]),
    # 2,500 to 3,600 letters; past about 2,900 a text meets llguidance's 2,000 items in a row.
    "ranges-nested": (
        'root ::= (("a"|"b"){50,60}){50,60}',
        ["a" * 2500, "ab" * 1250, "b" * 2500],
        ["a" * 2499, "a" * 100, "c" * 2500],
    ),
    # Neighbours: alternation inside the quantified group, groups three deep, rule references.
    "alternation-under-star": ('root ::= ("a" | "b"+)* "c"', ["c", "abbac", "bbbc"], ["ab", "ca"]),
    "alternation-count-under-plus": ('root ::= (("a" | "bc"){2})+', ["aa", "abc", "bcbcaa"], ["a", "abca", "b"]),
    "three-deep": ('root ::= ((("a"+)?){2})* "."', [".", "a.", "aaaa."], ["", "b.", "a"]),
    "three-deep-counts": ('root ::= ((("a" | "b"){2}){2}){2}', ["abbaabba", "a" * 8], ["a" * 7, "a" * 9]),
    "rule-counted": ('root ::= item{2,3}\nitem ::= "x" | "y" item', ["xx", "yxx", "xyyx", "xxx"], ["x", "xxxx"]),
    "rule-group-counted": ('root ::= (item+){2}\nitem ::= "x" | "y" item', ["xx", "xyx", "xxx"], ["x", "y"]),
    "terminal-rule-group": ('root ::= (tok?)* "."\ntok ::= [0-9]{2}', [".", "12.", "1234."], ["1.", "123."]),
    # Quantifiers in a row apply in turn, as llama.cpp applies them.
    "stacked-quantifiers": ('root ::= "a"+* "b" "c"{2}?', ["b", "aab", "bcc"], ["bc", "ba"]),
    "stacked-on-a-group": ('root ::= ("a" "b"){2}+', ["abab", "abababab"], ["ab", "ababab"]),
    # Other GBNF llguidance's own conversion writes as Lark that is refused or means otherwise.
    "count-zero": ('root ::= "a"{0} "b" ("c"{0,0})*', ["b"], ["ab", "bc"]),
    "dot-is-any-character": ("root ::= . .", ["\n\n", "é\t", "xy"], ["x", "xyz"]),
    "unicode-escapes": (r'root ::= "\u00e9" [\u4e00-\u9fff] "\U0001F600" [\U0001F600]', ["é中😀😀"], ["e中😀😀"]),
    "escapes-in-literals": (r'root ::= "\[\]\-\x41\t"', ["[]-A\t"], ["\\[\\]-A\t"]),
    "raw-controls-in-literals": ('root ::= "a\tb\x01"', ["a\tb\x01"], ["ab\x01"]),
    "class-syntax": (r"root ::= [&&] [~~] [a^] [a\-z] [/[]", ["&~^-/", "&~a-["], ["a~^-/", "&~^b/"]),
    "class-dashes": ("root ::= [a-z-0] [--0] [!--]", ["--,", "q/!", "00-"], ["A-!", "-1!", "--."]),
    # Tokens: here token i is byte i, so <[97]> is "a" as a token, !<[97]> any token but it.
    "token-id": ('root ::= <[97]> "b"', ["ab"], ["bb", "a", "abb"]),
    # A run of !<...> ended by a token, as in llama.cpp's own example (see gbnf.py on text after one).
    "not-a-token": ('root ::= "x" !<[97]>* <[97]> "."', ["xa.", "xbca."], ["xbc.", "xaa.", "a."]),
    "token-in-a-rule": ('root ::= tok{2} "."\ntok ::= <[97]> | "b"', ["aa.", "ab.", "bb."], ["a.", "ac."]),
    "token-in-a-group": ('root ::= (<[97]> [0-9])* "!"', ["!", "a1a2!"], ["a!", "1!"]),
    "class-empty": ('root ::= ([z-a] | "b") [^z-a] "x" [] "y"', ["b\nxy", "bzxy"], ["zzxy", "bx y"]),
    "a-bound-past-2000-is-none": ('root ::= "a"{1,5000}', ["a" * 5001], [""]),
    "rule-names": (
        'root ::= 2a AB ab aB a-b start\n2a ::= "1"\nAB ::= "2"\nab ::= "3"\naB ::= "4"\na-b ::= "5"\n'
        'start ::= "6" | "6" start\n',
        ["123456", "1234566"],
        ["12345", "1234456"],
    ),
}


@pytest.mark.parametrize(("gbnf", "takes", "refuses"), FORMS.values(), ids=FORMS.keys())
def test_gbnf_is_translated_as_llama_cpp_reads_it(gbnf: str, takes: list[str], refuses: list[str]) -> None:
    matches = language(gbnf)
    assert [text for text in takes if not matches(text)] == []
    assert [text for text in refuses if matches(text)] == []


def test_groups_under_quantifiers_keep_their_parentheses() -> None:
    for gbnf, rule in (
        ('root ::= ("a"+)* "b"', 'start: ("a"+)* "b"'),
        ('root ::= (("a"){2})?', 'start: ("a"{2,2})?'),
        ('root ::= (("a"|"b"){50,60}){50,60}', 'start: ((("a" | "b")){50,60}){50,60}'),
        ('root ::= "a"+*', 'start: ("a"+)*'),
        ('root ::= ("a" "b")+', 'start: ("a" "b")+'),  # as llguidance writes it
    ):
        assert to_lark(gbnf) == "%llguidance {}\n\n" + rule + "\n"


def test_gbnf_llama_cpp_refuses_is_refused() -> None:
    for gbnf, needle in (
        ('root ::= "a"{3,2}', "below its least"),  # llama.cpp never finishes reading it
        ('root ::= "a"{2001}', "more than 2000 repetitions"),
        (r'root ::= "\ud800"', "not a Unicode character"),
        (r'root ::= "\q"', "Invalid escape"),
        (r'root ::= "\u12"', r"Invalid \\u escape"),
        ('root ::= !"a"', "expected '<'"),
        ("root ::= <[12", "expected ']>'"),
        ("root ::= <[4294967296]>", "too big"),
        ("root ::= <abc", "expected '>'"),
        ("root ::= <end>", "no vocabulary"),  # a token by its text needs the model's
    ):
        with pytest.raises(GbnfError, match=needle):
            to_lark(gbnf)


def test_tokens_by_their_text_are_the_vocabularys() -> None:
    def token_id(text: str) -> int | None:
        return {"<end>": 256, "<a>": 97}.get(text)

    assert to_lark("root ::= <a> !<end>* <end>", token_id) == "%llguidance {}\n\nstart: <[97]> <[^256]>* <[256]>\n"
    with pytest.raises(GbnfError, match="'<b>' is not one token"):
        to_lark("root ::= <b>", token_id)
    # Through the cache, with the matcher's own vocabulary (one token per byte): "<ab>" is four.
    with pytest.raises(GrammarError, match="not one token"):
        GrammarCache(BYTES).build("gbnf", "root ::= <ab>")


def test_lark_refusals_of_translated_gbnf_do_not_quote_the_lark() -> None:
    cache = GrammarCache(BYTES)
    # A rule name llama.cpp would not read (llguidance's parser does, Lark does not).
    with pytest.raises(GrammarError) as refused:
        cache.build("gbnf", 'root ::= é\né ::= "x"')
    message = str(refused.value)
    assert message.startswith("the GBNF grammar was refused: ")
    assert "start" not in message and "%llguidance" not in message and "\n" not in message
    # Lark sent as Lark keeps llguidance's message, which quotes what the client wrote.
    with pytest.raises(GrammarError, match="start: "):
        cache.build("gbnf", 'start: "a"+*\n')
    assert cache.build("gbnf", 'root ::= ("a"+)* "b"').kind == "gbnf"
