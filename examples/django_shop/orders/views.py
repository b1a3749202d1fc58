"""POST /orders places an order and enqueues its receipt in one transaction; GET /orders/ID reads both."""

import json

from django.db import transaction
from django.http import HttpRequest, JsonResponse
from django.shortcuts import get_object_or_404
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_GET, require_POST

from orders.models import Order
from orders.tasks import send_receipt

STOCK = 10


class OutOfStock(Exception):
    pass


@csrf_exempt
@require_POST
def place_order(request: HttpRequest) -> JsonResponse:
    data = json.loads(request.body)
    try:
        with transaction.atomic():
            order = Order.objects.create(
                email=data["email"], item=data["item"], quantity=data.get("quantity", 1)
            )
            # Inside atomic(): the job is a row of hybridq's outbox on this very connection.
            order.receipt_job = send_receipt.enqueue(order.id).id
            order.save(update_fields=["receipt_job"])
            if order.quantity > STOCK:
                raise OutOfStock
    except OutOfStock:
        # Rolled back: no order, and no receipt job either.
        return JsonResponse({"error": f"out of stock: at most {STOCK}"}, status=409)
    return JsonResponse({"order": order.id, "receipt_job": order.receipt_job}, status=201)


@require_GET
def order_status(request: HttpRequest, order_id: int) -> JsonResponse:
    order = get_object_or_404(Order, id=order_id)
    result = send_receipt.get_result(order.receipt_job)  # from hybridq's journal, not Redis
    receipt = {"status": result.status, "attempts": result.attempts}
    if result.status == "SUCCESSFUL":
        receipt["return_value"] = result.return_value
    return JsonResponse(
        {"order": order.id, "receipt_sent": order.receipt_sent_at is not None, "receipt": receipt}
    )
