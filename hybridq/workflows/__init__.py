"""Workflows: chains, groups, chords and their file (docs/workflows.md).

Owns the shapes users build (:mod:`~hybridq.workflows.canvas`: ``sig``, ``chain``, ``group``,
``chord``, compiled into one graph the producer journals) and the forwarder's workflows' file
(:mod:`~hybridq.workflows.store`, read by ``fetch_job`` and ``status``). May use the envelope and
the errors only: the producer, the forwarder and ``job`` all import it.
"""
