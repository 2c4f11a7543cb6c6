"""Build step pyproject.toml cannot express: the scheduler's hot path compiled with mypyc.

The modules libra_hpc/_compiled.py lists (COMPILED) are type-checked and compiled
to C extensions placed beside their sources (``pip install -e .`` builds them in place).
If compiling fails (no C compiler, a mypy that refuses the code), the install goes on
without them and the scheduler runs as pure Python; the build log says why.
"""

from __future__ import annotations

import sys

from setuptools import setup
from setuptools.command.build_ext import build_ext

COMPILED = ("state", "tree", "routers", "protocol", "records", "service")  # = libra_hpc._compiled.COMPILED (a test checks)


class OptionalBuildExt(build_ext):
    """build_ext that leaves the pure-Python modules in place when compiling fails."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001 - any compiler failure; the sources still work
            print(f"libra_hpc: compiling the scheduler failed ({exc}); it will run as pure Python", file=sys.stderr)

    def build_extension(self, ext) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001
            print(f"libra_hpc: compiling {ext.name} failed ({exc}); it will run as pure Python", file=sys.stderr)


def extensions() -> list:
    try:
        from mypyc.build import mypycify
    except ImportError as exc:
        print(f"libra_hpc: mypyc is not available ({exc}); the scheduler will run as pure Python", file=sys.stderr)
        return []
    try:
        # Imports outside the compiled modules are followed silently (config.py needs the
        # pydantic plugin to type-check, and the build environment has no pydantic).
        return mypycify(["--follow-imports=silent", "--ignore-missing-imports",
                         *(f"libra_hpc/scheduler/{module}.py" for module in COMPILED)],
                        opt_level="3", group_name="libra_hpc.scheduler._mypyc")  # its shared library stays in the package
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - mypy reports type errors by exiting
        print(f"libra_hpc: mypyc refused the scheduler ({exc}); it will run as pure Python", file=sys.stderr)
        return []


setup(ext_modules=extensions(), cmdclass={"build_ext": OptionalBuildExt})
