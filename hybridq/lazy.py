"""Names of a package that load on first use (PEP 562), so importing one part loads no other.

``hybridq`` and ``hybridq.journal`` use it: a worker process imports ``hybridq.worker`` without
the producer, and ``hybridq.journal.paths`` without the journal's reader, writer and CRC library.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_names"]


def lazy_names(
    namespace: dict[str, Any], where: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A package's ``__getattr__`` and ``__dir__`` for the names ``where`` maps to their modules.

    A submodule not imported yet is imported when asked for as an attribute too
    (``hybridq.journal.reader`` after ``import hybridq.journal``), as if the package had.

    Args:
        namespace: the package's ``globals()``: a name loaded once is kept there.
        where: each name's module, relative to the package (``".producer"``).
    """
    package = namespace["__name__"]

    def __getattr__(name: str) -> Any:  # noqa: N807 - the module hook's name
        """Import a public name's module on first use and cache the name in the package."""
        module = where.get(name)
        if module is not None:
            value = getattr(importlib.import_module(module, package), name)
        elif not name.startswith("_") and importlib.util.find_spec(f"{package}.{name}") is not None:
            value = importlib.import_module(f"{package}.{name}")  # a submodule, as after its import
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        namespace[name] = value
        return value

    def __dir__() -> list[str]:  # noqa: N807 - the module hook's name
        return sorted({*namespace, *namespace.get("__all__", ())})

    return __getattr__, __dir__
