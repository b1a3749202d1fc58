"""The burn-down benchmark's tasks and the peers' apps (``bench/burndown.py``).

A package beside the bench scripts so that every worker process (hybridq, RQ, Dramatiq, Huey,
Celery) imports the same task bodies by name, with ``bench/`` on its ``PYTHONPATH``; each peer's
app lives in its own module so that a worker imports only its own framework.
"""
