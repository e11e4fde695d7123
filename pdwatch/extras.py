"""Which optional part of the distribution each command needs, and the error that says so.

The engine side needs only the OTel SDK; everything else comes with an extra
(pyproject.toml's [project.optional-dependencies]). A command whose extra is
not installed stops with the pip line that fixes it, not a traceback.
"""

from __future__ import annotations

import importlib
import types

# Command -> the extra that brings what it imports.
EXTRA_OF = {
    "serve": "sidecar",
    "trace": "sidecar",
    "diagnose": "sidecar",
    "report": "report",
    "demo": "testbed",
    "testbed": "testbed",
    "dashboards": "dashboards",
}


class MissingExtra(RuntimeError):
    def __init__(self, command: str, extra: str, module: str):
        super().__init__(f"pdwatch {command} needs the '{extra}' extra, which is not installed "
                         f"(no module {module!r}): pip install 'pdwatch[{extra}]'")
        self.command, self.extra, self.module = command, extra, module


def load(command: str, module_name: str) -> types.ModuleType:
    """Import a command's module; a third-party module missing from its extra is a MissingExtra."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if missing == "pdwatch" or missing.startswith("pdwatch.") or command not in EXTRA_OF:
            raise  # a bug, or a broken install of pdwatch itself
        raise MissingExtra(command, EXTRA_OF[command], missing) from None
