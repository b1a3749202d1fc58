"""The Django app (``INSTALLED_APPS = [..., "hybridq.contrib.django"]``): its management commands."""

from __future__ import annotations

from django.apps import AppConfig


class HybridqConfig(AppConfig):
    """hybridq's app: ``manage.py hybridq_forward``, ``hybridq_worker`` and ``hybridq_outbox_init``."""

    name = "hybridq.contrib.django"
    label = "hybridq"
    verbose_name = "hybridq"
