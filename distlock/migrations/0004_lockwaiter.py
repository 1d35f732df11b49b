"""Create the database backend's waiter queue: one row per blocking acquire waiting for a lock.

A free lock goes to the live waiter of its name with the lowest id (``distlock.backends._sql``); the
unique owner lets a waiter refresh its own row in the statement that tries the lock.
"""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('distlock', '0003_metricsample'),
    ]

    operations = [
        migrations.CreateModel(
            name='LockWaiter',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('name', models.CharField(db_index=True, max_length=255, verbose_name='name')),
                ('owner', models.CharField(max_length=64, unique=True, verbose_name='owner')),
                ('expires_at', models.DateTimeField(verbose_name='expires at')),
            ],
            options={
                'verbose_name': 'lock waiter',
                'verbose_name_plural': 'lock waiters',
            },
        ),
    ]
