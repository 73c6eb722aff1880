"""The bounds of the process's settings, checked once they are parsed (``parse_settings``): a
value that cannot work is refused at start with one line that says why (the command exits 2),
not met at the first connection, signal or request (a NaN deadline, a port past 65535 taken
modulo 65536, an empty API key that any request matches, a semaphore of -1 connections). The
bounds of a model's own settings, which presets set too, are ``settings.model_settings_error``.
"""

from __future__ import annotations

import math
import os
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from server.settings import Settings

# llama.cpp's LLAMA_MAX_DEVICES (the binding's llama_max_devices, which a test compares).
MAX_DEVICES = 16
# A request head smaller than this cannot carry a browser's ordinary headers.
MIN_HEADER_SIZE = 1024
# Pings more often than this would be most of a waiting stream's bytes.
MIN_PING_INTERVAL = 0.1
_UNQUANTIZED = ("f32", "f16", "bf16")
# An origin as a browser sends it: scheme://host[:port], no path.
_ORIGIN = re.compile(r"[a-z][a-z0-9+.-]*://[^/\s?#]+")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def settings_error(s: Settings) -> str | None:
    """The first setting that cannot work, as the line that says so; None when all can."""
    for check in (_network, _timings, _keys, _limits, _names):
        problem = check(s)
        if problem is not None:
            return problem
    return None


def _network(s: Settings) -> str | None:
    if not 0 <= s.port <= 65535:
        return "--port must be between 0 and 65535"
    if s.fd is not None and s.fd < 0:
        return "--fd must be a file descriptor (0 or more)"
    if s.max_connections < 1:
        return "--max-connections must be at least 1"
    if s.max_body < 1:
        return "--max-body must be at least 1 byte"
    if s.max_header_size < MIN_HEADER_SIZE:
        return f"--max-header-size must be at least {MIN_HEADER_SIZE} bytes"
    for origin in s.cors_origin:
        if origin not in {"*", "localhost"} and not _ORIGIN.fullmatch(origin):
            return f"--cors-origin {origin!r}: an origin is scheme://host[:port] (no path), *, or localhost"
    return None


def _timings(s: Settings) -> str | None:
    for name in ("keep_alive_timeout", "read_timeout", "write_timeout", "restart_timeout", "models_load_timeout"):
        if not 0 < getattr(s, name) < math.inf:  # also NaN
            return f"{_flag(name)} must be a positive, finite number of seconds"
    if not 0 <= s.drain_timeout < math.inf:
        return "--drain-timeout must be a finite number of seconds, 0 or more"
    if not MIN_PING_INTERVAL <= s.ping_interval < math.inf:
        return f"--ping-interval must be a finite number of seconds, at least {MIN_PING_INTERVAL}"
    if s.sleep_idle_seconds is not None and not 0 < s.sleep_idle_seconds < math.inf:
        return "--sleep-idle-seconds must be a positive, finite number of seconds"
    return None


def _keys(s: Settings) -> str | None:
    for name in ("api_key", "admin_key"):
        if any(not key.strip() for key in getattr(s, name)):
            return f"{_flag(name)} must not be empty (any request would match it)"
    if s.api_key_file is not None:
        try:
            keys = s.file_keys()
        except (OSError, UnicodeDecodeError) as exc:
            return f"--api-key-file {s.api_key_file}: {getattr(exc, 'strerror', None) or exc}"
        if not keys:
            return f"--api-key-file {s.api_key_file}: the file holds no key (the server would be open to all)"
    return None


def _limits(s: Settings) -> str | None:
    if s.cache_ram < 0:
        return "--cache-ram must be 0 (off) or a number of MiB"
    if not 0 < s.responses_max_mb < math.inf:  # also NaN
        return "--responses-max-mb must be a positive, finite number of MiB (fractions allowed)"
    if s.max_tokens is not None and s.max_tokens < 1:
        return "--max-tokens must be at least 1"
    if s.temp is not None and not 0.0 <= s.temp <= 2.0:
        return "--temp must be between 0 and 2"
    if s.seed is not None and not 0 <= s.seed < 2**32:
        return "--seed must be between 0 and 4294967295"
    for name in ("models_max", "models_max_mb"):
        value = getattr(s, name)
        if value is not None and value < 1:
            return f"{_flag(name)} must be at least 1"
    if len(s.tensor_split) > MAX_DEVICES:
        return f"--tensor-split has {len(s.tensor_split)} values; llama.cpp takes at most {MAX_DEVICES} devices"
    if s.flash_attn == "off" and s.cache_type_v not in _UNQUANTIZED:
        return f"--cache-type-v {s.cache_type_v} needs flash attention: --flash-attn on or auto"
    return None


def _names(s: Settings) -> str | None:
    for name in ("responses_db", "models_dir", "models_preset", "chat_template", "chat_template_file"):
        if getattr(s, name) == "":
            return f"{_flag(name)} must not be empty"
    if s.alias is not None and not any(part.strip() for part in s.alias.split(",")):
        return "--alias must name the model"
    if s.slot_save_path is not None and not os.path.isdir(s.slot_save_path):
        return f"--slot-save-path {s.slot_save_path}: not a folder"
    if s.chat_template is not None and s.chat_template_file is not None:
        return "--chat-template and --chat-template-file cannot both be given"
    return None
