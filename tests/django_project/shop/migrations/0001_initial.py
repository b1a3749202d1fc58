from django.db import migrations, models


class Migration(migrations.Migration):
    initial = True
    dependencies = []
    operations = [
        migrations.CreateModel(
            name="Order",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False)),
                ("item", models.CharField(max_length=100)),
                ("state", models.CharField(default="new", max_length=20)),
            ],
        ),
    ]
