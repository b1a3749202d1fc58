"""Huey's side: ``RedisHuey`` at ``$BURN_REDIS_URL`` (its defaults) and one task per workload.

``huey_consumer burn.huey_app.huey`` runs it (one worker thread by default).
"""

from __future__ import annotations

import os

from huey import RedisHuey

from burn import tasks

huey = RedisHuey("burn", url=os.environ["BURN_REDIS_URL"])
TASKS = {name: huey.task(name=name)(fn) for name, fn in tasks.WORKLOADS.items()}
