"""The example's task: an ``async def``, which ``hybridq worker`` runs on its event loop.

Plain functions work the same way (the worker runs them on threads): docs/worker.md.
"""

from __future__ import annotations

import asyncio


async def word_count(text: str) -> dict[str, int]:
    """Count the words of ``text`` (after a short wait, as a real task would spend on I/O)."""
    await asyncio.sleep(0.05)
    return {"words": len(text.split()), "chars": len(text)}
