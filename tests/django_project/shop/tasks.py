"""The shop's tasks, declared with the framework's own ``@task`` (Django 6, or the backport).

Each run logs a line in ``$SHOP_EFFECTS`` (``start``/``done``, the order, the pid) so the test
counts runs and effects. ``fulfil``'s first run, when ``$SHOP_HANG_FIRST`` names a file that
does not exist yet, creates it and then hangs: the test SIGKILLs the worker there.
"""

import os
import time

try:
    from django.tasks import task
except ImportError:
    from django_tasks import task

from shop.models import Order


def log(what: str, order_id: object) -> None:
    fd = os.open(os.environ["SHOP_EFFECTS"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, f"{what} {order_id} {os.getpid()}\n".encode())
    finally:
        os.close(fd)


@task()
def fulfil(order_id: int) -> dict:
    log("start", order_id)
    gate = os.environ.get("SHOP_HANG_FIRST")
    if gate:
        try:
            fd = os.open(gate, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            pass
        else:
            os.close(fd)
            time.sleep(120)  # the test SIGKILLs the worker now
    Order.objects.filter(id=order_id).update(state="fulfilled")
    log("done", order_id)
    return {"order": order_id, "state": "fulfilled"}


@task()
def ship(order_id: int) -> str:
    log("ship", order_id)
    return f"shipped {order_id}"


@task(queue_name="emails", priority=5)
def add(a: int, b: int) -> int:
    return a + b


@task()
def boom(message: str) -> None:
    raise ValueError(message)


@task(takes_context=True)
def whoami(context, tag: str) -> dict:
    return {"id": context.task_result.id, "attempt": context.attempt, "tag": tag}


@task()
async def double(x: int) -> int:
    return 2 * x
