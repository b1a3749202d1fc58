"""``POST /v1/jobs/{id}/cancel``: who may cancel what (docs/security.md, docs/http.md).

A token cancels only the jobs it enqueued with an ``Idempotency-Key`` (their key is scoped to
it); never another token's, an unkeyed one, nor a job a local producer wrote. A cross-site form
cannot cancel (415, as for ``POST /v1/jobs``). Each test about 0.3 s.
"""

from __future__ import annotations

import os
from pathlib import Path

import hybridq
from hybridq.cancels import cancel_dir

from tests.support.http import request, served
from tests.unit.test_http_api import ADD, config, write_tokens

A = {"Authorization": "Bearer token-a-0123456789abcdef"}
B = {"Authorization": "Bearer token-b-0123456789abcdef"}


def requests_in(journal: Path) -> int:
    """How many cancel requests the journal holds."""
    where = cancel_dir(str(journal))
    return len(os.listdir(where)) if os.path.isdir(where) else 0


def test_a_token_cancels_only_the_keyed_jobs_it_enqueued(journal_dir: Path, tmp_path: Path) -> None:
    """Fails before: token B cancelled token A's job and a local producer's (200 requested)."""
    tokens = write_tokens(tmp_path / "tokens", A["Authorization"][7:], B["Authorization"][7:])
    hybridq.Queue("default", journal_dir).enqueue_call("tests.tasks.add", (1, 2), None, job_id="invoice-1")
    with served(config(journal_dir, tokens_file=tokens)) as base:
        keyed = request(base, "POST", "/v1/jobs", ADD, {**A, "Idempotency-Key": "k1"}).json["id"]
        unkeyed = request(base, "POST", "/v1/jobs", ADD, A).json["id"]
        for headers, job_id in ((B, keyed), (B, "invoice-1"), (A, "invoice-1"), (A, unkeyed)):
            got = request(base, "POST", f"/v1/jobs/{job_id}/cancel", {}, headers)
            assert (got.status, got.json["error"]) == (403, "forbidden"), (headers, job_id)
        assert requests_in(journal_dir) == 0
        got = request(base, "POST", f"/v1/jobs/{keyed}/cancel", {}, A)
        assert (got.status, got.json) == (200, {"id": keyed, "state": "requested"})
        assert requests_in(journal_dir) == 1


def test_a_cross_site_form_cannot_cancel_on_a_node_without_tokens(journal_dir: Path) -> None:
    """Fails before: a form POST from a foreign origin cancelled the job (200)."""
    with served(config(journal_dir)) as base:
        job = request(base, "POST", "/v1/jobs", ADD).json["id"]
        form = {"Content-Type": "application/x-www-form-urlencoded", "Origin": "https://evil.example"}
        got = request(base, "POST", f"/v1/jobs/{job}/cancel", b"x=1", form)
        assert (got.status, got.json["error"]) == (415, "unsupported_media_type")
        assert requests_in(journal_dir) == 0
        got = request(base, "POST", f"/v1/jobs/{job}/cancel", {})  # no tokens: any HTTP job
        assert (got.status, got.json["state"]) == (200, "requested")
