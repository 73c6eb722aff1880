"""Pure parts of serving many models: which models the command line, a folder and a presets
file name (``server/models/specs.py``), and which models to unload (``policy.py``)."""

from __future__ import annotations

import pathlib

import pytest

from server.models.policy import Resident, idle_expired, make_room
from server.models.specs import ModelSpecError, is_multi_model, model_specs
from server.settings import MAX_PARALLEL, parse_settings


def touch(path: pathlib.Path, size: int = 10) -> pathlib.Path:
    path.write_bytes(b"\0" * size)
    return path


def test_the_single_model_command_line_is_unchanged(tmp_path: pathlib.Path) -> None:
    model = touch(tmp_path / "m.gguf")
    settings = parse_settings(["--model", str(model), "--alias", "mine"], env={})
    assert not is_multi_model(settings)
    [spec] = model_specs(settings)
    assert (spec.id, spec.path, spec.load_on_start) == ("mine", str(model), True)


def test_folder_list_and_presets(tmp_path: pathlib.Path) -> None:
    folder = tmp_path / "models"
    folder.mkdir()
    touch(folder / "alpha.gguf", 100)
    for i in (1, 2, 3):
        touch(folder / f"big-{i:05d}-of-00003.gguf", 7)
    touch(folder / "notes.txt")
    extra = touch(tmp_path / "x.gguf")
    preset = tmp_path / "p.toml"
    preset.write_text(
        '[alpha]\naliases = ["a", "first"]\nctx_size = 1024\nload_on_start = true\n'
        f'[gamma]\nmodel = "{extra}"\nembeddings = true\n'
    )
    argv = ["--models-dir", str(folder), "--model", f"ex={extra}", "--models-preset", str(preset), "--parallel", "3"]
    specs = {s.id: s for s in model_specs(parse_settings(argv, env={}))}
    assert list(specs) == ["ex", "alpha", "big", "gamma"]
    assert specs["alpha"].aliases == ("a", "first") and specs["alpha"].load_on_start
    assert specs["alpha"].settings.ctx_size == 1024 and specs["alpha"].settings.parallel == 3
    assert specs["big"].path.endswith("big-00001-of-00003.gguf") and specs["big"].file_bytes() == 21
    assert specs["gamma"].settings.embeddings and not specs["ex"].settings.embeddings


def test_ini_presets_are_typed(tmp_path: pathlib.Path) -> None:
    model = touch(tmp_path / "m.gguf")
    preset = tmp_path / "p.ini"
    preset.write_text(f"[m]\nmodel = {model}\nparallel = 2\nembeddings = yes\naliases = x, y\n")
    [spec] = model_specs(parse_settings(["--models-preset", str(preset)], env={}))
    assert spec.settings.parallel == 2 and spec.settings.embeddings and spec.aliases == ("x", "y")


@pytest.mark.parametrize(
    ("preset", "says"),
    [
        ("[m]\nparallel = many\n", "not a int"),
        ("[m]\nbogus = 1\n", "unknown keys bogus"),
        ("[m]\nport = 1\n", "unknown keys port"),
        ("[n]\nctx_size = 5\n", "no file"),
        ("[m]\naliases = other\n[other]\nmodel = {model}\n", "used by both"),
        # a shape llama.cpp cannot make is refused at start, not at the model's first request
        ("[m]\nctx_size = -1\n", r"\[m\]: ctx_size must be 0 \(the model's own\) or at least parallel"),
        ("[m]\nparallel = 0\n", r"\[m\]: parallel must be between 1 and 256"),
        ("[m]\nparallel = 8\nctx_size = 4\n", "ctx_size must be"),
        ("[m]\nbatch_size = -5\n", "batch_size must be between 1 and 2147483647"),
        ("[m]\nthreads = 0\n", "threads must be between 1 and 512"),
        ("[m]\nthreads = 99999\n", "threads must be between 1 and 512"),  # OpenMP failed: a crash
        ("[m]\nmax_queue = 0\n", "max_queue must be at least 1"),  # every request was a 503
        ("[ ]\nmodel = {model}\n", "a model id must not be empty"),
        ("[m]\npooling = sum\n", "pooling must be mean, cls or last"),
    ],
)
def test_bad_presets_say_why(tmp_path: pathlib.Path, preset: str, says: str) -> None:
    model = touch(tmp_path / "m.gguf")
    file = tmp_path / "p.ini"
    file.write_text(preset.format(model=model))
    with pytest.raises(ModelSpecError, match=says):
        model_specs(parse_settings(["--model", f"m={model}", "--models-preset", str(file)], env={}))


@pytest.mark.parametrize("value", ["5", "{x = 1}", '["a", 2]', '[""]', "true"])
def test_toml_names_must_be_strings(tmp_path: pathlib.Path, value: str) -> None:
    # An integer was a TypeError and a traceback at start; a table's keys became aliases.
    model = touch(tmp_path / "m.gguf")
    for key in ("aliases", "tags"):
        file = tmp_path / "p.toml"
        file.write_text(f'[m]\nmodel = "{model}"\n{key} = {value}\n')
        with pytest.raises(ModelSpecError, match=f"{key} must be names"):
            model_specs(parse_settings(["--models-preset", str(file)], env={}))


def test_alias_and_tags_name_no_model_of_several(tmp_path: pathlib.Path) -> None:
    # They were dropped without a word, and the alias was a 404.
    model = touch(tmp_path / "m.gguf")
    for flag in ("--alias", "--tags"):
        with pytest.raises(ModelSpecError, match=f"{flag} names the one model of a single-model command line"):
            model_specs(parse_settings(["--model", f"a={model}", "--model", f"b={model}", flag, "x"], env={}))


def test_cache_ram_is_shared_by_the_models_loaded_at_once(tmp_path: pathlib.Path) -> None:
    # Found by review: each model had the whole --cache-ram, N models N times it.
    model = touch(tmp_path / "m.gguf")
    four = [arg for id_ in "abcd" for arg in ("--model", f"{id_}={model}")]
    assert {s.settings.cache_ram for s in model_specs(parse_settings([*four, "--cache-ram", "4096"], env={}))} == {1024}
    two_at_once = parse_settings([*four, "--cache-ram", "4096", "--models-max", "2"], env={})
    assert {s.settings.cache_ram for s in model_specs(two_at_once)} == {2048}
    [single] = model_specs(parse_settings(["--model", str(model), "--cache-ram", "4096"], env={}))
    assert single.settings.cache_ram == 4096


def test_duplicate_ids_and_an_empty_folder(tmp_path: pathlib.Path) -> None:
    model = touch(tmp_path / "m.gguf")
    with pytest.raises(ModelSpecError, match="given twice"):
        model_specs(parse_settings(["--model", f"a={model}", "--model", f"a={model}"], env={}))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelSpecError, match="no models"):
        model_specs(parse_settings(["--models-dir", str(empty)], env={}))


def r(id_: str, busy: bool = False, used: float = 0.0, size: int = 10) -> Resident:
    return Resident(id_, busy, used, size)


def test_make_room_takes_the_least_recently_used_idle_models() -> None:
    loaded = [r("a", used=3), r("b", used=1), r("c", used=2)]
    assert make_room(loaded, 10, max_models=None, max_bytes=None) == []
    assert make_room(loaded, 10, max_models=4, max_bytes=None) == []
    assert make_room(loaded, 10, max_models=3, max_bytes=None) == ["b"]
    assert make_room(loaded, 10, max_models=2, max_bytes=None) == ["b", "c"]
    assert make_room(loaded, 25, max_models=None, max_bytes=40) == ["b", "c"]


def test_make_room_never_takes_a_busy_model() -> None:
    loaded = [r("a", busy=True, used=0), r("b", used=5)]
    assert make_room(loaded, 10, max_models=2, max_bytes=None) == ["b"]
    assert make_room(loaded, 10, max_models=1, max_bytes=None) is None
    assert make_room([r("a", busy=True)], 10, max_models=None, max_bytes=15) is None
    assert make_room([], 100, max_models=1, max_bytes=50) is None  # it can never fit


def test_idle_expired() -> None:
    loaded = [r("a", used=0), r("b", used=9), r("c", busy=True, used=0)]
    assert idle_expired(loaded, now=10, sleep_after=5) == ["a"]
    assert idle_expired(loaded, now=10, sleep_after=None) == []


def test_alias_list_and_tags_as_llama_server() -> None:
    """``--alias a,b,c``: every one a name of the model, the first in order its id; ``--tags``
    listed with it."""
    one = ["--model", "m.gguf"]  # a path of its own: no default model needed (make test-unit hides it)
    settings = parse_settings([*one, "--alias", "tinyllama-2, fim,code", "--tags", "chat,fim,small,chat"], env={})
    [spec] = model_specs(settings)
    assert spec.id == "code" and set(spec.names) == {"code", "fim", "tinyllama-2"}
    assert spec.tags == ("chat", "fim", "small")
    [plain] = model_specs(parse_settings([*one, "--alias", "mine"], env={}))
    assert plain.id == "mine" and plain.names == ("mine",) and plain.tags == ()


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--ctx-size", "3", "--parallel", "4"], "--ctx-size must be 0 (the model's own) or at least parallel (4)"),
        (["--ctx-size", "-1"], "--ctx-size must be"),
        (["--parallel", "0"], "--parallel must be between 1 and 256"),
        (["--parallel", "257"], "--parallel must be between 1 and 256"),
        (["--batch-size", "0"], "--batch-size must be between 1 and 2147483647"),
        (["--batch-size", "99999999999"], "--batch-size must be between 1 and 2147483647"),
        (["--threads", "-2"], "--threads must be between 1 and 512"),
        (["--threads", "513"], "--threads must be between 1 and 512"),
        (["--max-queue", "-1"], "--max-queue must be at least 1"),
        (["--max-queue", "0"], "--max-queue must be at least 1"),
    ],
)
def test_a_model_shape_llama_cpp_cannot_make_is_refused(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_settings(argv, env={})
    assert exc.value.code == 2
    assert says in capsys.readouterr().err


def test_the_parallel_bound_is_llama_cpps() -> None:
    from ffi._lib import lib

    assert lib.llama_max_parallel_sequences() == MAX_PARALLEL
