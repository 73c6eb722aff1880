"""setuptools' entry to the native build (everything else is in pyproject.toml).

A wheel's ``build_ext`` makes ``ffi._llama`` with ``build_ffi.build``, the same steps as ``make
ffi``, into the wheel's ``ffi/``: llama.cpp's libraries beside the extension, ``$ORIGIN`` its
search path. An editable install (``pip install -e .``) builds nothing native: the checkout's
in-place build is ``make setup`` (or ``python build_ffi.py``), which the binding's ImportError
names.
"""

from __future__ import annotations

import pathlib
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import build_ffi  # a module of this checkout or sdist, beside this file


class BuildLlamaExtension(build_ext):
    """``build_ext`` whose one extension is built by ``build_ffi.build``."""

    def run(self) -> None:
        if self.inplace or getattr(self, "editable_mode", False):
            print("llama-trio: editable install; build the binding in place with `make setup`", file=sys.stderr)
            return
        super().run()

    def build_extension(self, ext: Extension) -> None:
        build_ffi.build(pathlib.Path(self.get_ext_fullpath(ext.name)), pathlib.Path(self.build_temp))


setup(
    # Its sources are build_ffi's business; the entry makes the wheel platform-specific and
    # gives build_ext its target path.
    ext_modules=[Extension(build_ffi.MODULE, sources=[])],
    cmdclass={"build_ext": BuildLlamaExtension},
)
