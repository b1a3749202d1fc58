"""``manage.py hybridq_forward``, ``hybridq_worker`` and ``hybridq_outbox_init``."""
