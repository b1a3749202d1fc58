"""The root of the tree, apart so that every module of this package can subclass it.

Its own module (not ``__init__``) so that the role modules import it without importing the
package's ``__init__``, which imports them (docs/architecture.md, ``errors``).
"""

from __future__ import annotations


class HybridqError(Exception):
    """Base class of every error hybridq raises on purpose."""
