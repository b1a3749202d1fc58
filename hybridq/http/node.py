"""The node name of a journal directory: which ingest node's journal holds a job (docs/http.md).

Several ``hybridq serve`` (or ``forward --serve``) nodes behind one client each write their own
journal. Every job id a node makes carries its journal's node name (``http-<node>-<hash>``), so:

* a keyed POST retried on another node makes another id there, never the same id in two
  journals (RQ keeps one job hash per id in the shared Redis; the workers' claim of the shared
  idempotency key is what runs the key once: docs/http.md, "Several nodes");
* any node can tell from an id which node holds the job, and says so (``GET /v1/jobs/{id}``
  answers ``404`` with ``"node"``): the remote client then asks that node, and reports it as
  down rather than the job as missing.

The name is 8 random hex digits made once per journal directory and kept in the state file
``node.state`` (whole or absent after a crash); a server and a forwarder of one directory share
it. It is taken by linking a complete file into place, so two processes starting at once agree.
"""

from __future__ import annotations

import os
import secrets

from hybridq.client.ids import NODE_NAME, node_of
from hybridq.errors import NodeDown, StateFileCorrupt
from hybridq.journal.fileops import OS_FILEOPS
from hybridq.journal.statefile import STATE_SUFFIX, read_state, write_state

__all__ = ["NODE_STATE", "NodeDown", "node_name", "node_of"]

#: The state file (``<journal>/node.state``) that holds the journal's node name.
NODE_STATE = "node"


def node_name(journal: str) -> str:
    """The journal's node name, made (durably) on the first call for this directory.

    Raises:
        StateFileCorrupt: ``node.state`` exists but is damaged or holds no name (never replaced:
            the ids already made name it).
    """
    raw = read_state(journal, NODE_STATE)
    if raw is None:
        temp = f"{NODE_STATE}.{os.getpid()}.{secrets.token_hex(4)}"
        write_state(journal, temp, secrets.token_hex(4).encode())
        temp_path = os.path.join(journal, temp + STATE_SUFFIX)
        try:
            os.link(temp_path, os.path.join(journal, NODE_STATE + STATE_SUFFIX))
        except FileExistsError:
            pass  # another process named it first: its name is the journal's
        finally:
            os.unlink(temp_path)
        OS_FILEOPS.fsync_dir(journal)
        raw = read_state(journal, NODE_STATE)
    name = (raw or b"").decode("ascii", "replace")
    if not NODE_NAME.fullmatch(name):
        raise StateFileCorrupt(os.path.join(journal, NODE_STATE + STATE_SUFFIX), f"not a node name: {name!r}")
    return name
