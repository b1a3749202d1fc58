"""A mistyped task name is refused where it can be told (issue 27's paper cut).

``enqueue``, ``hybridq enqueue`` and ``POST /v1/jobs`` accepted ``tasks.sendd``: the job stayed
pending forever (workers left it, again and again), never reached ``failed list``, and filled
``--capacity``. A producer that has imported the task's module now refuses a name it lacks
(nothing written); ``hybridq enqueue`` imports the module to check, and says so when it cannot;
``hybridq serve`` checks what it imported (``--import``) with the workers' own rules, so a class
whose call runs another module's constructor is refused there too. Names in modules a producer
has not imported are accepted: the worker decides (docs/worker.md).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hybridq import Queue
from hybridq.errors import NoSuchTask

from tests import guarded_tasks, tasks
from tests.conftest import PYTHON
from tests.support.http import request, served
from tests.unit.test_http_api import ADD, config, job_ids

assert tasks.add  # imported: the producer can see tests.tasks
assert guarded_tasks.touch


@pytest.mark.parametrize(
    ("path", "owner", "name"),
    [
        ("tests.tasks.sendd", "tests.tasks", "sendd"),
        ("tests.guarded_tasks.Tools.nope", "tests.guarded_tasks.Tools", "nope"),
        ("tests.nope", "tests", "nope"),  # the last part, on a package: no module is called
    ],
)
def test_enqueue_refuses_a_name_an_imported_module_lacks(
    journal_dir: Path, path: str, owner: str, name: str
) -> None:
    with pytest.raises(NoSuchTask, match=f"no such function {path}: {owner} has no attribute '{name}'"):
        Queue(journal=journal_dir).enqueue(path, 1)
    assert job_ids(journal_dir) == []


def test_enqueue_takes_names_it_cannot_check(journal_dir: Path) -> None:
    queue = Queue(journal=journal_dir)
    queue.enqueue("myapp.not_imported_here.send", 1)  # no module of it in this process
    queue.enqueue("tests.not_imported_here.send", 1)  # a package's module this process lacks
    queue.enqueue("tests.tasks.add", 1, 2)
    assert len(job_ids(journal_dir)) == 3


def _cli(env: dict[str, str], cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(Path(sys.executable).with_name("hybridq")), *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_hybridq_enqueue_checks_the_name_where_it_can_import_the_module(
    journal_dir: Path, tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    (tmp_path / "mytasks.py").write_text("def send(to):\n    return to\n", encoding="utf-8")
    journal = ["--journal", str(journal_dir)]
    typo = _cli(subprocess_env, tmp_path, "enqueue", *journal, "mytasks.sendd", '"ada"')
    assert typo.returncode == 1, typo
    assert typo.stderr.strip().splitlines() == [
        "hybridq: error: no such function mytasks.sendd: mytasks has no attribute 'sendd' (nothing was enqueued)"
    ]
    good = _cli(subprocess_env, tmp_path, "enqueue", *journal, "mytasks.send", '"ada"')
    assert good.returncode == 0, good.stderr
    assert good.stderr == ""
    elsewhere = _cli(subprocess_env, tmp_path, "enqueue", *journal, "billing.charge", "1")
    assert elsewhere.returncode == 0, elsewhere.stderr  # the workers may have it
    [note] = elsewhere.stderr.splitlines()
    assert note.startswith("hybridq: note: cannot check that billing.charge exists here")
    assert "hybridq doctor" in note
    assert len(job_ids(journal_dir)) == 2


def test_serve_refuses_what_its_imported_modules_lack_or_the_workers_would_refuse(journal_dir: Path) -> None:
    with served(config(journal_dir, allow=("tests",))) as base:
        typo = request(base, "POST", "/v1/jobs", {"task": "tests.tasks.sendd", "args": [1]})
        proc = request(
            base,
            "POST",
            "/v1/jobs",
            {"task": "tests.guarded_tasks.Proc", "kwargs": {"args": "id > f", "shell": True}},
        )
        imported = request(
            base, "POST", "/v1/jobs", {"task": "tests.guarded_tasks.os.system", "args": ["id"]}
        )
        unknown = request(base, "POST", "/v1/jobs", {"task": "tests.not_imported_here.send"})
        good = request(base, "POST", "/v1/jobs", ADD)
    assert (typo.status, proc.status, imported.status) == (400, 400, 400)  # before: 202 each
    assert "no such function tests.tasks.sendd" in typo.json["detail"]
    assert "subprocess.Popen.__init__" in proc.json["detail"]
    assert "module the allowed one imports" in imported.json["detail"]
    assert (unknown.status, good.status) == (202, 202)
    assert len(job_ids(journal_dir)) == 2


def test_jobs_that_can_never_run_do_not_fill_the_capacity(journal_dir: Path) -> None:
    """Issue 27 (LOW): a mistyped task never became terminal, so POSTs of it filled ``--capacity``
    for good, and every client got 429."""
    with served(config(journal_dir, capacity=2)) as base:
        typos = [request(base, "POST", "/v1/jobs", {"task": "tests.tasks.sendd"}).status for _ in range(3)]
        after = request(base, "POST", "/v1/jobs", ADD)
    assert typos == [400, 400, 400]  # before: 202, 202, 429
    assert after.status == 202


def test_the_check_costs_nothing_for_a_name_seen_before(journal_dir: Path) -> None:
    """Checked once per name: the module's attributes are not walked at every enqueue."""
    from hybridq.security import allow

    queue = Queue(journal=journal_dir)
    queue.enqueue("tests.tasks.add", 1, 2)
    calls = []
    real = allow.check_name

    def counting(path: str) -> bool:
        calls.append(path)
        return real(path)

    allow.check_name = counting  # type: ignore[assignment]
    try:
        for _ in range(3):
            queue.enqueue("tests.tasks.add", 1, 2)
    finally:
        allow.check_name = real  # type: ignore[assignment]
    assert calls == []
    assert PYTHON
