"""The server launcher that llama.cpp's own test suite starts (``bench/peer_suite.py`` points
its ``LLAMA_SERVER_BIN_PATH`` here): it takes llama-server's command line and execs either
llama-server itself or our server, with the default model in place of any model the suite would
download.

- ``--target llama-server``: llama-server's flags as they are, less the hub flags
  (``--hf-repo``, ``--hf-file``, ``--model-url``, ``--offline``), plus ``--model`` (the default
  model) when none is given.
- ``--target ours``: each of llama-server's flags mapped to ours where we have the same thing
  (``MAPPED``); flags that change nothing a test can see dropped (``DROPPED``); anything else
  passed on as it is, so that our command line refuses it (exit 2) and the test that needs it
  fails, as it should.

The process execs the server, so the suite's ``terminate()`` reaches the server itself.
``--threads`` gives both servers the same CPU threads where the suite sets none (on a shared
machine, llama.cpp's threads that wait on each other stall when one is preempted).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

# llama-server flag -> our flag (each takes a value where llama-server's does).
MAPPED = {
    "--port": "--port",
    "--host": "--host",
    "--model": "--model",
    "-m": "--model",
    "--ctx-size": "--ctx-size",
    "-c": "--ctx-size",
    "--parallel": "--parallel",
    "-np": "--parallel",
    "--batch-size": "--batch-size",
    "-b": "--batch-size",
    "--threads": "--threads",
    "-t": "--threads",
    "--alias": "--alias",
    "--tags": "--tags",
    "--api-key": "--api-key",
    "--pooling": "--pooling",
    "--chat-template-file": "--chat-template-file",
    "--chat-template": "--chat-template",
    "--cache-ram": "--cache-ram",
    "--n-predict": "--max-tokens",
    "--slot-save-path": "--slot-save-path",
    "--temp": "--temp",
    "--seed": "--seed",
}
SWITCHES = {
    "--embedding": "--embeddings",
    "--embeddings": "--embeddings",
    "--no-ui": "--no-webui",
    "--verbose": "--verbose",
    "--no-slots": "--no-slots",
}
# Flags that change nothing the suite can see of our server: the hub (the default model stands in
# for every model), things we always do (metrics, Jinja templates, continuous batching, the
# slots endpoint), and llama.cpp tuning we leave at its default. (--no-jinja asks llama-server
# for its built-in templates; ours renders the model's template with Jinja either way.)
DROPPED_SWITCHES = {"--no-jinja", "--offline", "--metrics", "--jinja", "--cont-batching", "--slots"}
DROPPED_VALUES = {
    "--hf-repo",
    "--hf-file",
    "--model-url",
    "--ubatch-size",
    "-ub",
    "--n-gpu-layers",
    "-ngl",
}
HUB_VALUES = {"--hf-repo", "--hf-file", "--model-url"}


def _default_model() -> str:
    from server.model_files import default_model_path

    return str(default_model_path())


def llama_server_args(argv: Sequence[str]) -> list[str]:
    """llama-server's own command line with the default model in place of the hub's."""
    out: list[str] = []
    it = iter(argv)
    has_model = False
    for arg in it:
        if arg in HUB_VALUES:
            next(it, None)
        elif arg == "--offline":
            continue
        else:
            has_model = has_model or arg in {"--model", "-m"}
            out.append(arg)
    return out if has_model else [*out, "--model", _default_model()]


def our_args(argv: Sequence[str], drop_switches: Sequence[str] = (), drop_values: Sequence[str] = ()) -> list[str]:
    """llama-server's command line as ours (see the module's docstring); ``drop_switches`` and
    ``drop_values`` also dropped (an older checkout that lacks them, for a before/after)."""
    out: list[str] = []
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        value = args[i + 1] if i + 1 < len(args) else None
        if arg in MAPPED and value is not None and arg not in drop_values:
            if not (arg == "--n-predict" and int(value) < 0):  # -1: no ceiling, ours without --max-tokens
                out += [MAPPED[arg], value]
            i += 2
        elif arg == "--cors-origins" and value is not None:
            for origin in value.split(","):
                out += ["--cors-origin", origin.strip()]
            i += 2
        elif arg in SWITCHES and arg not in drop_switches:
            out.append(SWITCHES[arg])
            i += 1
        elif arg in DROPPED_SWITCHES or arg in drop_switches:
            i += 1
        elif arg in DROPPED_VALUES or arg in drop_values:
            i += 2
        else:
            out.append(arg)
            i += 1
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", choices=["llama-server", "ours"], required=True)
    parser.add_argument("--llama-server", help="llama-server binary (for --target llama-server)")
    parser.add_argument("--checkout", default=".", help="the checkout whose server is ours (for --target ours)")
    parser.add_argument("--threads", type=int, help="CPU threads for either server, unless the suite sets them")
    parser.add_argument("--drop-switch", action="append", default=[], help="also drop this flag (ours)")
    parser.add_argument("--drop-value", action="append", default=[], help="also drop this flag and its value (ours)")
    parser.add_argument("rest", nargs=argparse.REMAINDER, help="llama-server's command line, after --")
    ns = parser.parse_args(argv)
    rest = ns.rest[1:] if ns.rest[:1] == ["--"] else ns.rest
    if ns.threads is not None and not {"--threads", "-t"} & set(rest):
        rest = [*rest, "--threads", str(ns.threads)]
    if ns.target == "llama-server":
        exe = ns.llama_server
        if not exe:
            parser.error("--llama-server is needed for --target llama-server")
        command = [exe, *llama_server_args(rest)]
    else:
        command = [sys.executable, "-m", "server", *our_args(rest, ns.drop_switch, ns.drop_value)]
        os.chdir(ns.checkout)  # python -m server runs that checkout's server
    print("peer adapter: " + " ".join(command), file=sys.stderr, flush=True)
    os.execv(command[0], command)


if __name__ == "__main__":
    main()
