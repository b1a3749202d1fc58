"""Celery's side: the Redis broker at ``$BURN_REDIS_URL``, no result backend, one task per workload.

``celery -A burn.celery_app worker`` runs it (prefork, a process per core by default).
"""

from __future__ import annotations

import os

from celery import Celery

from burn import tasks

app = Celery("burn", broker=os.environ["BURN_REDIS_URL"])
TASKS = {name: app.task(name=f"burn.{name}")(fn) for name, fn in tasks.WORKLOADS.items()}
