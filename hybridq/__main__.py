"""``python -m hybridq``: the same as the ``hybridq`` command."""

from hybridq.cli import main

if __name__ == "__main__":
    main()
