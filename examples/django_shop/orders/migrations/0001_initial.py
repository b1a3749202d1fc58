from django.db import migrations, models


class Migration(migrations.Migration):
    initial = True
    dependencies = []
    operations = [
        migrations.CreateModel(
            name="Order",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False)),
                ("email", models.EmailField(max_length=254)),
                ("item", models.CharField(max_length=100)),
                ("quantity", models.PositiveIntegerField(default=1)),
                ("receipt_job", models.CharField(blank=True, max_length=64)),
                ("receipt_sent_at", models.DateTimeField(null=True)),
            ],
        ),
    ]
