"""``manage.py shop [setup] [enqueue]``, ``manage.py shop die FILE`` or ``manage.py shop results ID...``: the test's steps, through the tasks framework's public API only.

Each step prints one JSON line. ``setup`` migrates and creates the outbox table; ``enqueue``
enqueues inside committed, rolled-back and nested transactions and outside any, and tries bad
input; ``results ID...`` reads the jobs back with ``get_result`` / ``aget_result``.
"""

import asyncio
import datetime as dt
import io
import json
import os
import signal

from django.core.management import call_command
from django.core.management.base import BaseCommand
from django.db import connection, transaction
from django.utils import timezone

try:
    from django.tasks import default_task_backend
except ImportError:
    from django_tasks import default_task_backend

from shop.models import Order
from shop.tasks import add, boom, double, fulfil, ship, whoami


class Rollback(Exception):
    pass


def outbox_rows() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM hybridq_outbox")
        return cursor.fetchone()[0]


def error_of(call) -> str:
    try:
        call()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}".splitlines()[0]
    return "no error"


def setup() -> dict:
    call_command("migrate", verbosity=0)
    sql = io.StringIO()
    call_command("hybridq_outbox_init", "--print-sql", stdout=sql)
    call_command("hybridq_outbox_init", stdout=io.StringIO())
    return {"outbox_rows": outbox_rows(), "sql": sql.getvalue()}


def enqueue() -> dict:
    out: dict = {}
    try:
        with transaction.atomic():
            order = Order.objects.create(item="rolled back")
            out["rolled_back"] = fulfil.enqueue(order.id).id
            raise Rollback
    except Rollback:
        pass
    out["rows_after_rollback"] = outbox_rows()
    with transaction.atomic():
        order = Order.objects.create(item="book")
        result = fulfil.enqueue(order.id)
        out["committed"], out["order"], out["status_at_enqueue"] = result.id, order.id, result.status
    out["rows_after_commit"] = outbox_rows()
    out["status_in_outbox"] = fulfil.get_result(out["committed"]).status
    with transaction.atomic():
        out["nested_kept"] = add.enqueue(1, 1).id
        try:
            with transaction.atomic():
                out["nested_dropped"] = add.enqueue(2, 2).id
                raise Rollback
        except Rollback:
            pass
    out["rows_after_nested"] = outbox_rows()
    transaction.set_autocommit(False)  # a transaction managed by hand, not atomic()
    try:
        out["manual_rolled_back"] = add.enqueue(5, 5).id
        transaction.rollback()
    finally:
        transaction.set_autocommit(True)
    out["rows_after_manual"] = outbox_rows()
    out["manual_after_rollback"] = error_of(lambda: add.get_result(out["manual_rolled_back"]))
    out["deferred"] = add.using(run_after=timezone.now() + dt.timedelta(hours=1)).enqueue(3, 4).id
    out["direct"] = add.enqueue(2, 3).id
    out["rows_after_direct"] = outbox_rows()
    out["async"] = asyncio.run(add.aenqueue(20, 22)).id
    out["boom"] = boom.enqueue("out of stock").id
    out["whoami"] = whoami.enqueue("ctx").id
    out["double"] = double.enqueue(21).id
    out["bad_queue"] = error_of(lambda: add.using(queue_name="nope").enqueue(1, 2))
    with transaction.atomic():
        out["not_json"] = error_of(lambda: add.enqueue(object(), 1))  # the framework refuses it
        out["nan"] = error_of(lambda: add.enqueue(float("nan"), 1))  # the framework takes it, JSON not
    out["missing"] = error_of(lambda: fulfil.get_result("01ARZ3NDEKTSV4RRFFQ69G5FAV"))
    out["rows_at_end"] = outbox_rows()
    return out


def die(ids_file: str) -> None:
    """Commit two orders, then SIGKILL this process before any on_commit hook's enqueue runs.

    Order A's job is enqueued inside the transaction (the outbox); order B's is enqueued by an
    on_commit hook, which never runs: the hook registered before it kills the process.
    """
    with transaction.atomic():
        a = Order.objects.create(item="in the transaction")
        job = ship.enqueue(a.id).id
        b = Order.objects.create(item="on_commit")
        with open(ids_file, "w") as out:
            json.dump({"a": a.id, "a_job": job, "b": b.id}, out)
        transaction.on_commit(lambda: os.kill(os.getpid(), signal.SIGKILL))
        transaction.on_commit(lambda: ship.enqueue(b.id))


def results(ids: list[str]) -> dict:
    out = {}
    for job_id in ids:
        try:
            result = default_task_backend.get_result(job_id)
        except Exception as exc:
            out[job_id] = {"error": type(exc).__name__}
            continue
        out[job_id] = {
            "status": str(result.status),
            "task": result.task.module_path,
            "attempts": result.attempts,
            "args": result.args,
            "return_value": result.return_value if str(result.status) == "SUCCESSFUL" else None,
            "errors": [e.exception_class_path for e in result.errors],
            "traceback": result.errors[0].traceback if result.errors else "",
            "finished": result.finished_at is not None,
        }
    if ids:
        again = asyncio.run(default_task_backend.aget_result(ids[0]))
        out["aget_result"] = {"id": again.id, "status": str(again.status)}
    return out


class Command(BaseCommand):
    def add_arguments(self, parser):
        parser.add_argument("steps", nargs="+", help="setup, enqueue, or results ID...")

    def handle(self, *args, **options):
        steps = options["steps"]
        if steps[0] == "die":
            die(steps[1])
        if steps[0] == "results":
            out = results(steps[1:])
        else:  # setup and enqueue, in one process
            out = {"setup": setup()} if "setup" in steps else {}
            if "enqueue" in steps:
                out.update(enqueue())
        self.stdout.write(json.dumps(out))
