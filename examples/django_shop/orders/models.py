from django.db import models


class Order(models.Model):
    email = models.EmailField()
    item = models.CharField(max_length=100)
    quantity = models.PositiveIntegerField(default=1)
    receipt_job = models.CharField(max_length=64, blank=True)
    receipt_sent_at = models.DateTimeField(null=True)
