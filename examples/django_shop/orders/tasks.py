"""The shop's task, declared with the tasks framework's own decorator."""

from django.utils import timezone

try:
    from django.tasks import task  # Django 6
except ImportError:
    from django_tasks import task  # Django 5.2 with the django-tasks backport

from orders.models import Order


@task(queue_name="emails")
def send_receipt(order_id: int) -> dict:
    order = Order.objects.get(id=order_id)
    # A real shop calls its mail provider here, with the job id as the idempotency key.
    Order.objects.filter(id=order_id, receipt_sent_at=None).update(receipt_sent_at=timezone.now())
    return {"order": order_id, "to": order.email, "item": order.item}
