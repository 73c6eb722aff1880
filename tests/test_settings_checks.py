"""Settings that cannot work are refused at start, each with one line (``server/settings_checks``).
Found by review: each of these started and then failed later, some with a traceback at the
first connection or signal, some silently (an empty key any request matched, a port taken
modulo 65536, an env boolean read as false)."""

from __future__ import annotations

import pathlib

import pytest

from server.settings import parse_settings
from server.settings_checks import MAX_DEVICES


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--api-key", ""], "--api-key must not be empty"),
        (["--api-key", "k", "--api-key", "  "], "--api-key must not be empty"),
        (["--admin-key", ""], "--admin-key must not be empty"),
        (["--keep-alive-timeout", "nan"], "--keep-alive-timeout must be a positive, finite number"),
        (["--keep-alive-timeout", "0"], "--keep-alive-timeout must be a positive, finite number"),
        (["--read-timeout", "-1"], "--read-timeout must be a positive, finite number"),
        (["--write-timeout", "nan"], "--write-timeout must be a positive, finite number"),
        (["--restart-timeout", "inf"], "--restart-timeout must be a positive, finite number"),
        (["--drain-timeout", "nan"], "--drain-timeout must be a finite number of seconds, 0 or more"),
        (["--drain-timeout", "-1"], "--drain-timeout must be a finite number of seconds, 0 or more"),
        (["--ping-interval", "0.0001"], "--ping-interval must be a finite number of seconds, at least 0.1"),
        (["--max-connections", "0"], "--max-connections must be at least 1"),
        (["--max-body", "0"], "--max-body must be at least 1 byte"),
        (["--max-header-size", "100"], "--max-header-size must be at least 1024 bytes"),
        (["--port", "70000"], "--port must be between 0 and 65535"),
        (["--max-tokens", "0"], "--max-tokens must be at least 1"),
        (["--fd", "-1"], "--fd must be a file descriptor"),
        (["--tensor-split", ",".join(["1"] * (MAX_DEVICES + 1))], "llama.cpp takes at most 16 devices"),
        (["--cors-origin", "http://a.test/"], "an origin is scheme://host[:port] (no path)"),
        (["--cors-origin", "a.test"], "an origin is scheme://host[:port]"),
        (["--responses-db", ""], "--responses-db must not be empty"),
        (["--models-dir", ""], "--models-dir must not be empty"),
        (["--chat-template", ""], "--chat-template must not be empty"),
        (["--alias", ","], "--alias must name the model"),
    ],
)
def test_a_setting_that_cannot_work_is_refused(argv: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_settings(argv, env={})
    assert exc.value.code == 2
    assert says in capsys.readouterr().err


def test_the_same_from_the_environment(capsys: pytest.CaptureFixture[str]) -> None:
    for env, says in (
        ({"LLAMA_TRIO_PORT": "70000"}, "--port must be between 0 and 65535"),
        ({"LLAMA_TRIO_NO_WEBUI": "ture"}, "LLAMA_TRIO_NO_WEBUI: 'ture' is not 1/0, true/false"),
        ({"LLAMA_TRIO_API_KEY": " , "}, None),  # a comma list of nothing names no key: auth off, as unset
    ):
        if says is None:
            assert parse_settings([], env=env).api_key == ()
            continue
        with pytest.raises(SystemExit):
            parse_settings([], env=env)
        assert says in capsys.readouterr().err
    assert parse_settings([], env={"LLAMA_TRIO_NO_WEBUI": "Yes"}).no_webui
    assert not parse_settings([], env={"LLAMA_TRIO_NO_WEBUI": "off"}).no_webui


def test_an_api_key_file_must_hold_a_key(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "keys"
    empty.write_text("# no keys yet\n\n")
    for path, says in (
        (empty, "the file holds no key"),
        (tmp_path / "missing", "No such file or directory"),
        (tmp_path, "Is a directory"),
    ):
        with pytest.raises(SystemExit):
            parse_settings(["--api-key-file", str(path)], env={})
        assert says in capsys.readouterr().err
    empty.write_text("# one key\nsecret\n")
    assert parse_settings(["--api-key-file", str(empty)], env={}).api_keys() == frozenset({"secret"})


def test_the_device_bound_is_llama_cpps() -> None:
    from ffi._lib import lib

    assert lib.llama_max_devices() == MAX_DEVICES
