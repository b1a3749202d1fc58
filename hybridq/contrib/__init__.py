"""Integrations with other frameworks, each an optional extra (``hybridq[django]``).

Nothing in hybridq imports this package: each integration sits on top of the public API
(producer, outbox, job lookup, the command line) and imports its framework itself.
"""
