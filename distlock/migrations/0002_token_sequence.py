"""Create the source of the database backend's fencing tokens.

PostgreSQL gets a real sequence: ``nextval()`` never goes backwards and is not rolled back, and it
serializes no transactions. Other databases use the single ``TokenSequence`` row, incremented in the
same transaction as the lock row.
"""

from django.db import migrations

SEQUENCE = "distlock_token_seq"


def create_token_source(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(f"CREATE SEQUENCE IF NOT EXISTS {SEQUENCE} AS bigint START 1")
    else:
        apps.get_model("distlock", "TokenSequence").objects.using(schema_editor.connection.alias).get_or_create(
            pk=1, defaults={"value": 0})


def drop_token_source(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(f"DROP SEQUENCE IF EXISTS {SEQUENCE}")


class Migration(migrations.Migration):
    dependencies = [("distlock", "0001_initial")]

    operations = [migrations.RunPython(create_token_source, drop_token_source)]
