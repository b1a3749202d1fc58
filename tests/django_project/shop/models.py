"""The shop's one model: an order, fulfilled by a task."""

from django.db import models


class Order(models.Model):
    item = models.CharField(max_length=100)
    state = models.CharField(max_length=20, default="new")
