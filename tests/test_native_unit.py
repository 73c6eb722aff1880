"""The pure parts of llama.cpp's native API: body parsing, the answer's fields, the FIM prompt."""

from __future__ import annotations

import math
import os
import stat

import pytest

from server.api import native_render, native_schema, slot_file
from server.api.native_infill import Extra, Fim, extra_chunks, infill_tokens
from server.engine import TokenLogprob, Usage


class FakeVocab:
    """Each character a token (its code point); 0 and 1 end generation."""

    n_tokens = 1000
    eog_tokens = frozenset({0, 1})

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        return [ord(c) for c in text]


def parse(**body: object) -> tuple:
    return native_schema.completion_request({"prompt": "x", **body}, [[5, 6]], FakeVocab())


def test_defaults_are_llama_servers() -> None:
    req, options = parse()
    assert (req.temperature, req.top_k, req.top_p, req.min_p) == (0.8, 40, 0.95, 0.05)
    assert req.max_tokens is None and req.seed is None and req.prompt == [5, 6]
    assert options.seed == native_schema.LLAMA_DEFAULT_SEED and options.n_predict == -1
    req, options = native_schema.completion_request(
        {"prompt": "x"}, [[5]], FakeVocab(), native_schema.Defaults(temperature=0.0, seed=9)
    )
    assert req.temperature == 0.0 and req.seed == 9 and options.seed == 9


def test_aliases_clamps_and_limits() -> None:
    req, options = parse(max_tokens=7, logprobs=3, n_cmpl=2, temperature=5.0, top_p=1.5)
    assert req.max_tokens == 7 and req.logprobs == 3 and options.n_probs == 3 and req.n == 2
    assert req.temperature == 5.0 and req.top_p == 1.0  # brought into range, as there ([0, inf) for temperature)
    assert (
        parse(temperature=-1)[0].temperature == 0.0 and parse(temperature=1e300)[0].temperature == native_schema.FLT_MAX
    )
    with pytest.raises(native_schema.NativeError):
        parse(n_predict=0)
    with pytest.raises(native_schema.NativeError):
        parse(n_probs=21)
    with pytest.raises(native_schema.NativeError):
        parse(stream="yes")
    with pytest.raises(native_schema.NativeError):
        parse(stop=[1])
    with pytest.raises(native_schema.NativeError):  # the OpenAI routes' bounds hold here too
        parse(stop=["x"] * 17)
    with pytest.raises(native_schema.NativeError):
        parse(cache_salt="")
    with pytest.raises(native_schema.NativeError):
        parse(logit_bias=[[1, 1]] * 301)


@pytest.mark.parametrize(
    ("body", "refused"),
    [
        ({"mirostat": 1}, "mirostat"),
        ({"mirostat": 0, "mirostat_eta": 0.3}, None),
        ({"mirostat": 2, "mirostat_eta": 0.3}, "mirostat"),
        ({"mirostat_eta": 0.3}, None),  # mirostat is off by default
        ({"xtc_probability": 0.5, "xtc_threshold": 0.1}, "xtc_probability"),
        ({"typical_p": 1.0, "top_n_sigma": -1, "dry_multiplier": 0}, None),
        ({"typical_p": 0.9}, "typical_p"),
        ({"dry_base": 1.75}, None),
        ({"dry_multiplier": 0.8, "dry_base": 1.75}, "dry_multiplier"),
        ({"samplers": ["top_k", "temperature"]}, "samplers"),
        ({"samplers": "edskypmxt"}, None),
        ({"repeat_last_n": 128}, None),  # no penalties: no window
        ({"repeat_last_n": 128, "repeat_penalty": 1.1}, "repeat_last_n"),
        ({"repeat_last_n": 64, "repeat_penalty": 1.1}, None),
        ({"id_slot": -1, "cache_prompt": False, "n_keep": 10}, None),
        ({"id_slot": 0}, None),  # a field of ours
        ({"lora": [{"id": 0, "scale": 1.0}]}, "lora"),
        ({"whatever": 1}, "whatever"),
        ({"whatever": None}, None),
    ],
)
def test_fields_refused_unless_off(body: dict, refused: str | None) -> None:
    assert native_schema.refused_field(body, native_schema.COMPLETION_FIELDS) == refused


@pytest.mark.parametrize("samplers", [5, 0, -1, 1.5, True, [{"a": 1}], [[]], ["top_k", 3], {"top_k": 1}])
def test_samplers_of_another_type_are_refused(samplers: object) -> None:
    """Found by review: these were a 500 (iterating a number, hashing a list)."""
    with pytest.raises(native_schema.NativeError) as caught:
        native_schema.refused_field({"samplers": samplers}, native_schema.COMPLETION_FIELDS)
    assert caught.value.param == "samplers"


def test_json_schema_and_grammar_are_one_or_the_other() -> None:
    # llama-server drops the schema when a grammar is given; a client who sent both was told
    # nothing of it. An empty grammar is none.
    with pytest.raises(native_schema.NativeError, match="not both") as refused:
        parse(grammar='root ::= "a"', json_schema={"type": "number"})
    assert refused.value.param == "json_schema"
    req, _ = parse(grammar="", json_schema={"type": "number"})
    assert req.json_schema == {"type": "number"} and req.grammar is None
    req, _ = parse(grammar='root ::= "a"')
    assert req.grammar == 'root ::= "a"' and req.json_schema is None


def test_logit_bias_forms() -> None:
    vocab = FakeVocab()
    assert native_schema.logit_bias([[65, 1.5], ["7", -2]], vocab) == {"65": 1.5, "55": -2.0}  # "7": text
    assert native_schema.logit_bias({"66": False}, vocab) == {"66": -math.inf}
    assert native_schema.logit_bias([["ab", -100]], vocab) == {"97": -100.0, "98": -100.0}
    assert native_schema.logit_bias({"ab": -100}, vocab) == {"97": -100.0, "98": -100.0}
    assert native_schema.logit_bias([[5000, 1]], vocab) is None  # outside the vocabulary: skipped
    assert native_schema.logit_bias({"9" * 5000: 1}, vocab) is None  # more digits than int() takes: skipped too
    assert native_schema.logit_bias({"0" * 5000 + "7": 1}, vocab) == {"7": 1.0}
    # text: each of its tokens gets the bias, once per time it occurs (the biases add up)
    assert native_schema.logit_bias([["0" * 5000 + "7", 1]], vocab) == {"48": 5000.0, "55": 1.0}
    assert native_schema.logit_bias([[65, 1.5], [65, 2], [66, False], [66, 3]], vocab) == {"65": 3.5, "66": -math.inf}


@pytest.mark.parametrize(
    ("key", "named"),
    [
        # What strtol(key, &end, 10) reads whole (*end == 0), as llama-server decides.
        ("15", 15),
        (" 15", 15),
        ("\t\n\v\f\r 15", 15),
        ("+15", 15),
        ("-15", -15),
        ("-0", 0),
        ("007", 7),
        ("", 0),  # strtol reads nothing and stops at the end
        ("15\0junk", 15),  # C reads the key up to its NUL
        ("\0junk", 0),
        ("9" * 5000, -1),  # overflow: skipped
        # Text.
        ("15 ", None),
        ("15x", None),
        ("0x1f", None),
        (" ", None),
        ("+", None),
        ("- 5", None),
        ("+-5", None),
        ("1.5", None),
        ("1e3", None),
        ("\u00a015", None),  # not C white space
        ("\u0661", None),  # not an ASCII digit
        ("abc", None),
    ],
)
def test_logit_bias_object_keys_read_as_strtol(key: str, named: int | None) -> None:
    assert native_schema.key_id(key) == named
    vocab = FakeVocab()
    bias = native_schema.logit_bias({key: 1.0}, vocab)
    if named is None:
        assert bias == ({str(ord(c)): 1.0 for c in key if ord(c) < vocab.n_tokens} or None)
    else:
        assert bias == ({str(named): 1.0} if 0 <= named < vocab.n_tokens else None)
    assert native_schema.logit_bias(None, vocab, ignore_eos=True) == {"0": -math.inf, "1": -math.inf}
    for bad in ([[1]], [[1, "x"]], "x", [[None, 1]], [[1, math.nan]]):
        with pytest.raises(native_schema.NativeError):
            native_schema.logit_bias(bad, vocab)


def test_stop_reason() -> None:
    assert native_render.stop_reason("length", "ab", "ab", ["x"]) == ("limit", "")
    assert native_render.stop_reason("stop", "hello ", "hello world", ["zz", "world"]) == ("word", "world")
    assert native_render.stop_reason("stop", "hello", "hello", ["world"]) == ("eos", "")
    assert native_render.stop_reason("cancelled", "", "", []) == ("none", "")


def test_pick_fields() -> None:
    payload = {"content": "x", "generation_settings": {"n_predict": 3}, "timings": {"a": 1}}
    picked = native_render.pick_fields(payload, ["content", "generation_settings/n_predict", "missing/x", "timings"])
    assert picked == {"content": "x", "generation_settings/n_predict": 3, "timings": {"a": 1}}


def test_timings_exclude_the_first_token_from_the_rate() -> None:
    usage = Usage(prompt_tokens=10, completion_tokens=5, cached_tokens=4)
    t = native_render.timings(usage, native_render.Timing(first=0.5, last=1.3), 5)
    assert t["prompt_n"] == 6 and t["cache_n"] == 4 and t["predicted_n"] == 5
    assert t["prompt_ms"] == pytest.approx(500) and t["predicted_ms"] == pytest.approx(800)
    assert t["predicted_per_second"] == pytest.approx(4 / 0.8)
    one = native_render.timings(Usage(3, 1, 0), native_render.Timing(first=0.2, last=0.2), 1)
    assert one["predicted_per_second"] == 0.0 and one["predicted_per_token_ms"] == 0.0
    assert all(math.isfinite(v) and v >= 0 for v in one.values())


def test_probabilities_have_no_infinities() -> None:
    items = [TokenLogprob(65, -math.inf, ((65, -math.inf), (66, -0.5)))]
    (entry,) = native_render.probabilities(items, lambda t: bytes([t]))
    assert entry["logprob"] == native_render.LOWEST_LOGPROB and entry["token"] == "A"
    assert entry["top_logprobs"] == [{"id": 66, "token": "B", "bytes": [66], "logprob": -0.5}]


FIM = Fim(prefix=900, suffix=901, middle=902, repository=903, separator=904, bos=None)


def chars(text: str) -> list[int]:
    return [ord(c) for c in text]


def test_infill_layout() -> None:
    tokens = infill_tokens(
        FIM, chars, prefix="ab", suffix="cd", prompt="P", extra=[Extra("f.h", "x")], n_batch=64, room=100
    )
    expected = [903, *chars("myproject\n"), 904, *chars("f.h\n"), *chars("x"), 904, *chars("filename\n")]
    expected += [900, *chars("abP"), 901, *chars("cd"), 902]
    assert tokens == expected


def test_infill_cuts_prefix_suffix_and_extra() -> None:
    no_repo = Fim(prefix=900, suffix=901, middle=902, repository=None, separator=None, bos=7)
    tokens = infill_tokens(no_repo, chars, prefix="a" * 50, suffix="b" * 50, prompt="", extra=[], n_batch=16, room=0)
    # 3/4 of the batch for the prefix (its end), the rest less two for the suffix (its start).
    assert tokens == [7, 900, *chars("a" * 12), 901, *chars("b" * 2), 902]
    snippet = infill_tokens(
        no_repo, chars, prefix="", suffix="", prompt="", extra=[Extra("n", "t")], n_batch=16, room=5
    )
    assert snippet[:5] == chars("---\n\nt")[-5:]  # the extra text's end, within its room


def test_extra_chunks_are_checked() -> None:
    assert extra_chunks([{"text": "a"}]) == [Extra("tmp", "a")]
    for bad in ({}, [{}], [{"filename": "ok"}], [{"filename": 1, "text": "a"}], [{"text": 5}]):
        with pytest.raises(native_schema.NativeError):
            extra_chunks(bad)


def test_slot_file_round_trip(tmp_path) -> None:
    folder = str(tmp_path)
    written = slot_file.write(folder, "s.bin", "fp_1", "a:", [5, 70000, 0], b"\x01\x02state")
    tokens, state, size = slot_file.read(folder, "s.bin", "fp_1", "a:")
    assert (tokens, state, size) == ([5, 70000, 0], b"\x01\x02state", written)
    with pytest.raises(slot_file.SlotFileError, match="another model"):
        slot_file.read(folder, "s.bin", "fp_2", "a:")
    own = tmp_path / slot_file.folder_name("a:")
    assert [p.name for p in tmp_path.iterdir()] == [own.name] and [p.name for p in own.iterdir()] == ["s.bin"]
    assert b"a:" not in (own / "s.bin").read_bytes() and "a:" not in own.name  # the owner only as a digest
    raw = (own / "s.bin").read_bytes()
    for bad in (b"", b"LLTRSLOT", raw[:-12], b"X" + raw[1:]):
        with pytest.raises(slot_file.SlotFileError):
            slot_file.decode(bad, "fp_1", "a:")
    # Another scope: none of that name (its own names are its own), and its save is its own file.
    with pytest.raises(FileNotFoundError):
        slot_file.read(folder, "s.bin", "fp_1", "b:")
    slot_file.write(folder, "s.bin", "fp_1", "b:", [1], b"x")
    assert slot_file.read(folder, "s.bin", "fp_1", "b:")[:2] == ([1], b"x")
    assert slot_file.read(folder, "s.bin", "fp_1", "a:")[:2] == ([5, 70000, 0], b"\x01\x02state")
    # A file of another owner put in a scope's folder is neither read nor replaced.
    (own / "theirs.bin").write_bytes((tmp_path / slot_file.folder_name("b:") / "s.bin").read_bytes())
    with pytest.raises(slot_file.NotOwner):
        slot_file.read(folder, "theirs.bin", "fp_1", "a:")
    with pytest.raises(slot_file.NotOwner):
        slot_file.write(folder, "theirs.bin", "fp_1", "a:", [1], b"x")


def test_slot_files_at_the_folders_top_are_their_owners(tmp_path) -> None:
    """A file saved before the scopes' folders (at the top): restored for its owner only, and
    nothing there (another's, not a slot, not a regular file) tells anyone else it exists."""
    slot_file.write(str(tmp_path), "s.bin", "fp_1", "a:", [5, 6], b"state")
    (tmp_path / "old.bin").write_bytes((tmp_path / slot_file.folder_name("a:") / "s.bin").read_bytes())
    (tmp_path / "junk.bin").write_bytes(b"not a slot file")
    (tmp_path / "dir.bin").mkdir()
    os.mkfifo(tmp_path / "fifo.bin")
    assert slot_file.read(str(tmp_path), "old.bin", "fp_1", "a:") == (
        [5, 6],
        b"state",
        (tmp_path / "old.bin").stat().st_size,
    )
    for name in ("old.bin", "junk.bin", "dir.bin", "fifo.bin", "missing.bin"):
        for scope in ("b:", "a:") if name != "old.bin" else ("b:",):
            with pytest.raises(FileNotFoundError):
                slot_file.read(str(tmp_path), name, "fp_1", scope)
    # A save goes to the scope's folder: the top's file stays as it was.
    before = (tmp_path / "old.bin").read_bytes()
    slot_file.write(str(tmp_path), "old.bin", "fp_1", "b:", [1], b"x")
    assert (tmp_path / "old.bin").read_bytes() == before


@pytest.mark.parametrize("length", [237, 238, 255])
def test_slot_file_names_of_any_accepted_length(tmp_path, length: int) -> None:
    """Found by review: the temporary name added 18 characters to the target's, past NAME_MAX."""
    written = slot_file.write(str(tmp_path), "n" * length, "fp_1", "a:", [1, 2], b"state")
    assert slot_file.read(str(tmp_path), "n" * length, "fp_1", "a:")[2] == written
    assert [p.name for p in (tmp_path / slot_file.folder_name("a:")).iterdir()] == ["n" * length]


def test_slot_file_refuses_what_is_not_a_regular_file(tmp_path) -> None:
    """Found by review: a directory was a 500, and opening a FIFO blocked its thread for ever."""
    own = tmp_path / slot_file.folder_name("a:")
    own.mkdir()
    (own / "dir.bin").mkdir()
    os.mkfifo(own / "fifo.bin")
    for name in ("dir.bin", "fifo.bin"):
        with pytest.raises(slot_file.SlotFileError, match="not a regular file"):
            slot_file.read(str(tmp_path), name, "fp_1", "a:")
        with pytest.raises(slot_file.SlotFileError, match="not a regular file"):
            slot_file.write(str(tmp_path), name, "fp_1", "a:", [1], b"x")
    assert (own / "dir.bin").is_dir() and stat.S_ISFIFO((own / "fifo.bin").lstat().st_mode)
    assert sorted(p.name for p in own.iterdir()) == ["dir.bin", "fifo.bin"]  # no temporary file left


def test_slot_file_storage_failure_is_its_own_error(tmp_path) -> None:
    with pytest.raises(slot_file.StorageError, match="cannot be written"):
        slot_file.write(str(tmp_path / "gone"), "s.bin", "fp_1", "a:", [1], b"x")
    # A link (or a file) where a scope's folder should be is not followed.
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / slot_file.folder_name("a:")).symlink_to(tmp_path / "elsewhere")
    with pytest.raises(slot_file.StorageError, match="cannot be used"):
        slot_file.write(str(tmp_path), "s.bin", "fp_1", "a:", [1], b"x")
    with pytest.raises(slot_file.StorageError, match="cannot be used"):
        slot_file.read(str(tmp_path), "s.bin", "fp_1", "a:")
    assert not list((tmp_path / "elsewhere").iterdir())


def test_a_slot_file_never_fills_the_disk(tmp_path) -> None:
    # Found by review: clients name their files and each salt is a folder of its own, so saves
    # could fill the disk the server shares. A save that would leave less than the reserve free
    # is refused, and nothing of it is left.
    disk = os.statvfs(tmp_path)
    free = disk.f_bavail * disk.f_frsize
    with pytest.raises(slot_file.StorageError, match="would leave less than"):
        slot_file.write(str(tmp_path), "s.bin", "fp_1", "a:", [1], b"x" * 4096, reserve=free)
    own = tmp_path / slot_file.folder_name("a:")
    assert not list(own.iterdir())
    assert slot_file.write(str(tmp_path), "s.bin", "fp_1", "a:", [1], b"x" * 4096, reserve=0) > 4096


def test_slot_op_refusals() -> None:
    from server.engine.choice import Slot
    from server.engine.slot_ops import SlotBusy, SlotOp, refusal

    slot = Slot(0)
    assert refusal(SlotOp("save", 0, "a:"), slot) is None  # empty: anyone's
    slot.cached, slot.scope = [1, 2], "b:"
    assert isinstance(refusal(SlotOp("save", 0, "a:"), slot), SlotBusy)  # another tenant's cache
    assert isinstance(refusal(SlotOp("erase", 0, "a:"), slot), SlotBusy)
    assert isinstance(refusal(SlotOp("restore", 0, "a:"), slot), SlotBusy)  # would drop it
    assert refusal(SlotOp("restore", 0, "b:"), slot) is None
    assert refusal(SlotOp("save", 0, "b:"), slot) is None
    slot.choice = object()  # type: ignore[assignment]
    assert isinstance(refusal(SlotOp("restore", 0, "b:"), slot), SlotBusy)


def test_parse_work_counts_every_text_the_parse_tokenizes() -> None:
    """Found by review: logit_bias texts, /infill's suffix and extra files were not counted, so
    their tokenizing ran on the event loop."""
    from server.api.native_prompt import parse_work
    from server.api.preflight import INLINE_WORK_CHARS

    text = "a" * INLINE_WORK_CHARS
    assert parse_work({"prompt": "x", "logit_bias": [[1, 1.0]] * 300}, infill=False) <= INLINE_WORK_CHARS
    for body in ({"logit_bias": [[text, 1.0]]}, {"logit_bias": {text: 1.0}}, {"logit_bias": [["a", 1]] * 40}):
        assert parse_work({"prompt": "x", **body}, infill=False) > INLINE_WORK_CHARS, body
    for body in ({"input_suffix": text}, {"input_extra": [{"text": text}]}, {"input_extra": [{"text": ""}] * 20}):
        assert parse_work({"prompt": "x", "input_prefix": "", **body}, infill=True) > INLINE_WORK_CHARS, body
    # Refused entries count for nothing (the parse stops there).
    assert parse_work({"prompt": "x", "input_extra": [5, {"text": text}]}, infill=True) <= INLINE_WORK_CHARS


class BosVocab(FakeVocab):
    """``FakeVocab`` whose tokenizer adds BOS (999) when asked, and reads "<s>" as one special
    token when parsing them (its code point otherwise, each character)."""

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        if parse_special and text == "<s>":
            return [998]
        return [999] * add_special + super().tokenize(text)


def test_mixed_adds_bos_only_when_asked_and_text_comes_first() -> None:
    """Found by review: /tokenize read ``add_special`` backwards for ids and text mixed (a text
    item tokenized first, with BOS, when it was false). As llama-server's ``tokenize_mixed``:
    BOS only with ``add_special`` and a text first; never for an empty sequence."""
    from server.api.native_prompt import mixed

    vocab = BosVocab()
    assert mixed([5, "ab"], vocab, add_special=False) == mixed([5, "ab"], vocab) == [5, 97, 98]
    assert mixed(["ab", 5], vocab, add_special=False) == [97, 98, 5]
    assert mixed(["ab", 5, "c"], vocab) == [999, 97, 98, 5, 99]
    assert mixed([], vocab) == mixed([], vocab, add_special=False) == []
    assert mixed([5, "<s>"], vocab) == [5, 998]
    assert mixed([5, "<s>"], vocab, parse_special=False) == [5, 60, 115, 62]


class CountedList(list):
    """A list that counts the items its iteration hands out."""

    handed = 0

    def __iter__(self):
        for item in super().__iter__():
            self.handed += 1
            yield item


def test_text_work_stops_once_past_the_inline_bound() -> None:
    """Found by review: the work of a /tokenize content or a native prompt was measured as
    ``len(str(value))``: a list of 1.9 million ids written out on the event loop (0.5 s) to
    find that it is large. The walk stops once past ``INLINE_WORK_CHARS``."""
    from server.api.native_prompt import TOKENIZE_CALL_CHARS, text_work
    from server.api.preflight import INLINE_WORK_CHARS

    ids = CountedList([1] * 1_000_000)
    assert text_work(ids) > INLINE_WORK_CHARS and ids.handed <= INLINE_WORK_CHARS + 2
    assert text_work("abc") == 3 and text_work([1, 2, "abc"]) == 2 + 3 + TOKENIZE_CALL_CHARS
    assert text_work([[1, 2], {"prompt_string": "ab"}]) == (2 + 1) + (2 + TOKENIZE_CALL_CHARS + 1)
    assert text_work(5) == text_work(None) == 0
    from server.api.native_prompt import parse_work

    assert parse_work({"prompt": CountedList([1] * 1_000_000)}, infill=False) > INLINE_WORK_CHARS


def test_unknown_fields_are_refused_by_name() -> None:
    known = frozenset({"content", "model"})
    native_schema.refuse_unknown({"content": "x", "model": "m", "foo": None}, known)  # null sets nothing
    with pytest.raises(native_schema.NativeError, match="'foo' is not supported") as error:
        native_schema.refuse_unknown({"content": "x", "foo": 1}, known)
    assert error.value.param == "foo"
    with pytest.raises(native_schema.NativeError) as error:
        native_schema.refuse_unknown({"x" * 10_000: 1}, known)
    assert error.value.param == "x" * native_schema.MAX_FIELD_NAME


@pytest.mark.parametrize(
    "value",
    [
        {"tokens": [{"id": i, "piece": f"é{i}"} for i in range(50_000)]},
        [1] * 100_000,
        [{"index": i, "embedding": [[i / 7] * 576]} for i in range(64)],
        {"content": "x" * 200_000, "n": None, "ok": True, "list": [], "object": {}},
        [[1] * 30_000, "x", [{"a": "b" * 70_000}, {"c": 1.5}]],
        {1: "a key that is not a string"},
        [],
        "text",
    ],
    ids=["pieces", "ids", "vectors", "text", "nested", "int-key", "empty", "scalar"],
)
def test_json_parts_are_json_dumps_in_parts(value: object) -> None:
    """A large answer is written in parts of about ``JSON_PART`` characters (each part one
    ``json.dumps`` call, the GIL let go between them): together, what one call writes."""
    import json

    from server.api.respond import JSON_PART, json_parts

    parts = json_parts(value)
    assert "".join(parts) == json.dumps(value, ensure_ascii=False)
    if isinstance(value, dict) and "tokens" in value:
        assert len(parts) > 10 and max(map(len, parts)) < 2 * JSON_PART
