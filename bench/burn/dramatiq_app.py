"""Dramatiq's side: a Redis broker at ``$BURN_REDIS_URL`` and one actor per workload.

``dramatiq burn.dramatiq_app`` runs it with Dramatiq's defaults (a process per core, 8 threads each).
"""

from __future__ import annotations

import os

import dramatiq
from dramatiq.brokers.redis import RedisBroker

from burn import tasks

broker = RedisBroker(url=os.environ["BURN_REDIS_URL"])
dramatiq.set_broker(broker)
ACTORS = {name: dramatiq.actor(fn, actor_name=name, broker=broker) for name, fn in tasks.WORKLOADS.items()}
