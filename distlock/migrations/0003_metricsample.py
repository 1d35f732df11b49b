"""Create the shared store of lock metrics: per-minute counts that every process adds to.

The unique key is what lets concurrent flushes from many processes add up (``INSERT ... ON CONFLICT
DO UPDATE SET count = count + excluded.count`` in ``distlock.metrics.store``).
"""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('distlock', '0002_token_sequence'),
    ]

    operations = [
        migrations.CreateModel(
            name='MetricSample',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('period_start', models.BigIntegerField(verbose_name='period start (Unix seconds)')),
                ('alias', models.CharField(max_length=255, verbose_name='alias')),
                ('prefix', models.CharField(max_length=255, verbose_name='lock-name prefix')),
                ('series', models.CharField(max_length=32, verbose_name='series')),
                ('bucket', models.SmallIntegerField(default=0, verbose_name='histogram bucket')),
                ('count', models.BigIntegerField(default=0, verbose_name='count')),
            ],
            options={
                'verbose_name': 'metric sample',
                'verbose_name_plural': 'metric samples',
                'constraints': [models.UniqueConstraint(fields=('period_start', 'alias', 'prefix', 'series', 'bucket'), name='distlock_metricsample_key')],
            },
        ),
    ]
