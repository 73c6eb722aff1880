"""The start's early model loads (``server/models/loading.py``) and what keeps a load out of
Python: llama.cpp's log lines and progress kept in C while a thread loads (``ffi/helpers.h``)."""

from __future__ import annotations

import logging
import pathlib
import threading

import pytest

import ffi
from server.engine import DecodeThread, Engine, EngineConfig
from server.models.loading import EarlyLoads, load
from server.models.memory import available_memory
from server.models.specs import model_specs
from server.settings import parse_settings
from tests.support.process import ServerProcess

GUARD = 120


def _settings(model_path: pathlib.Path, *extra: str):
    return parse_settings(["--model", str(model_path), "--parallel", "2", "--ctx-size", "512", *extra], env={})


def test_an_early_load_is_taken_once_with_the_engines_context(model_path: pathlib.Path) -> None:
    settings = _settings(model_path)
    loads = EarlyLoads.begin(settings)
    try:
        (spec,) = model_specs(settings)
        early = loads.pop(spec)
        assert early is not None and loads.pop(spec) is None
        loaded = early.take()
        try:
            assert loaded.context.model is loaded.model
            assert loaded.context.n_seq_max == 2 and loaded.context.n_ctx == 512
            assert early.progress.progress == 1.0
            left = available_memory()
            assert left is not None
            asked = settings.cache_ram * 1024 * 1024
            assert 0 < loaded.cache_bytes <= asked  # lowered only where memory is short
            assert loaded.cache_bytes == asked or left.bytes < 3 * asked
            assert [d.layers for d in loaded.devices if d.type == "cpu"] == [loaded.model.n_layer + 1]
        finally:
            loaded.close()
        assert loaded.model.closed
        with pytest.raises(ffi.ModelLoadError, match="already taken"):
            early.take()
    finally:
        loads.close()
        loads.close()  # idempotent


def test_an_aborted_early_load_fails_and_frees_what_it_made(model_path: pathlib.Path) -> None:
    settings = _settings(model_path)
    loads = EarlyLoads.begin(settings)
    (spec,) = model_specs(settings)
    early = loads.pop(spec)
    assert early is not None
    early.progress.abort()  # within microseconds of the start: the load is far from done
    with pytest.raises(ffi.ModelLoadError, match="aborted"):
        early.take()
    early.close()  # nothing left to free; idempotent
    loads.close()


def test_closing_loads_never_taken_waits_for_their_threads(model_path: pathlib.Path) -> None:
    before = {t.name for t in threading.enumerate()}
    loads = EarlyLoads.begin(_settings(model_path))
    assert any(t.name.startswith("load ") for t in threading.enumerate() if t.name not in before)
    loads.close()
    assert not any(t.name.startswith("load ") for t in threading.enumerate())


def test_the_engine_refuses_a_context_not_made_for_its_config(model: ffi.Model) -> None:
    config = EngineConfig(n_parallel=2, n_ctx=512, n_batch=256, n_threads=1)
    shapes = {
        "fits": dict(n_ctx=512, n_batch=256, n_seq_max=2, n_threads=1, kv_unified=False),
        "sequences": dict(n_ctx=512, n_batch=256, n_seq_max=1, n_threads=1, kv_unified=False),
        "cells": dict(n_ctx=1024, n_batch=256, n_seq_max=2, n_threads=1, kv_unified=False),
        "unified": dict(n_ctx=512, n_batch=256, n_seq_max=2, n_threads=1, kv_unified=True),
        "attention": dict(
            n_ctx=512, n_batch=256, n_seq_max=2, n_threads=1, kv_unified=False, attention=ffi.Attention(type_k="q8_0")
        ),
    }
    thread = DecodeThread()
    try:
        for name, shape in shapes.items():
            context = ffi.Context(model, **shape)  # type: ignore[arg-type]
            try:
                if name == "fits":
                    engine = Engine(model, config, thread, context)
                    assert engine.context is context
                else:
                    with pytest.raises(ValueError, match="not made for its model and its config"):
                        Engine(model, config, thread, context)
            finally:
                context.close()
    finally:
        thread.close()


def test_warnings_reach_the_logger_as_they_come(model: ffi.Model, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="llama_trio.llama_cpp")
    # More cells per sequence than the model was trained on: llama.cpp warns, in the middle of
    # the context's creation, whose other lines are kept in C until it ends.
    context = ffi.Context(model, n_ctx=model.n_ctx_train + 256, n_seq_max=1, n_threads=1)
    context.close()
    messages = [r.getMessage() for r in caplog.records if r.name == "llama_trio.llama_cpp"]
    warned = [i for i, m in enumerate(messages) if "n_ctx_train" in m and "overflow" in m]
    assert len(warned) == 1  # once: as it came, not again at the end
    # llama.cpp logged "constructing" before it warned; the debug line reached Python at the end.
    assert warned[0] < messages.index("llama_context: constructing llama_context")


def test_a_loads_log_and_progress_stay_in_c_until_it_ends(
    model_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    logger = logging.getLogger("tests.progress")
    caplog.set_level(logging.INFO, logger="tests.progress")
    caplog.set_level(logging.DEBUG, logger="llama_trio.llama_cpp")  # the handler's level: the last one set
    progress = ffi.ProgressReporter("m", logger)
    assert progress.progress == 0.0 and not progress.aborted
    with ffi.Model(model_path, progress=progress) as model:
        assert model.placement.total == model.n_layer + 1  # read from the captured lines
    assert progress.progress == 1.0
    names = [r.name for r in caplog.records]
    messages = [r.getMessage() for r in caplog.records]
    # Python heard of the progress once a quarter, not once a tensor...
    reported = [m for n, m in zip(names, messages, strict=True) if n == "tests.progress"]
    assert reported == ["loading m: 0%", "loading m: 25%", "loading m: 50%", "loading m: 75%", "loading m: 100%"]
    # ...and of llama.cpp's lines only at the end: every one comes after the last report, whole,
    # though llama.cpp logged the file's metadata before it loaded a tensor.
    lines = [m for n, m in zip(names, messages, strict=True) if n == "llama_trio.llama_cpp"]
    assert names.index("llama_trio.llama_cpp") > messages.index("loading m: 100%")
    assert len(lines) > 100 and lines[0].startswith("llama_model_loader:")
    assert any(t.startswith("load_tensors:") for t in lines)
    assert all("\n" not in t and "\0" not in t for t in lines)


def test_log_lines_does_not_nest() -> None:
    with ffi.log_lines(), pytest.raises(RuntimeError, match="does not nest"):
        with ffi.log_lines():
            pass
    with ffi.log_lines() as lines:  # usable again after the refusal
        pass
    assert lines == []


@pytest.mark.server
def test_a_start_that_fails_after_its_load_began_exits_cleanly(tmp_path: pathlib.Path) -> None:
    # The model's load begins before the chat template file is read: the failure must still be
    # one line and status 2, the load aborted and freed, no thread left to crash the exit.
    with ServerProcess(["--chat-template-file", str(tmp_path / "missing.jinja")]) as proc:
        assert proc.wait(GUARD) == 2
    assert f"llama-trio: cannot read the chat template file {tmp_path}/missing.jinja" in proc.log
    assert "Traceback" not in proc.log and "Fatal" not in proc.log


def test_a_context_size_of_zero_is_the_models_own(model_path: pathlib.Path) -> None:
    # llama-server's -c 0: the model's training context, shared by the sequences.
    settings = _settings(model_path, "--ctx-size", "0")
    (spec,) = model_specs(settings)
    loaded = load(spec, ffi.ProgressReporter(spec.id, logging.getLogger("test")))
    try:
        assert loaded.settings.ctx_size == loaded.model.n_ctx_train == loaded.context.n_ctx
        assert loaded.context.n_ctx_seq == loaded.model.n_ctx_train // 2
    finally:
        loaded.close()
