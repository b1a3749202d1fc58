"""Django's place for hybridq's management commands."""
