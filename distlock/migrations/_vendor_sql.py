"""``VendorSQL``: a ``RunSQL`` with its statements written per database vendor.

distlock's schema beyond its models (the token sequence, the token high-water mark) differs per
vendor. ``RunPython`` could branch on the vendor too, but ``sqlmigrate`` cannot print it, and a
deploy that applies only ``sqlmigrate`` output must get every step. The leading underscore keeps
Django's migration loader from reading this module as a migration.
"""

from django.db import migrations, router


class VendorSQL(migrations.RunSQL):
    """Run ``sql[vendor]`` forwards and ``reverse_sql[vendor]`` backwards; nothing for an unlisted vendor.

    The unlisted vendors are those the database backend refuses (``DatabaseBackend.check_combination``):
    there is no token source to create there, and migrating such a database (say, the MySQL database
    of a project whose locks are on Redis) must not fail.
    """

    def __init__(self, sql, reverse_sql, *, description, **kwargs):
        super().__init__(sql, reverse_sql, **kwargs)
        self.description = description

    def deconstruct(self):
        name, args, kwargs = super().deconstruct()
        return name, args, {**kwargs, "description": self.description}

    def describe(self):
        return self.description

    def database_forwards(self, app_label, schema_editor, from_state, to_state):
        if router.allow_migrate(schema_editor.connection.alias, app_label, **self.hints):
            self._run_sql(schema_editor, _statements(self.sql, schema_editor))

    def database_backwards(self, app_label, schema_editor, from_state, to_state):
        if router.allow_migrate(schema_editor.connection.alias, app_label, **self.hints):
            self._run_sql(schema_editor, _statements(self.reverse_sql, schema_editor))


def _statements(by_vendor, schema_editor):
    """Return the statements for the connection's vendor, trimmed so ``sqlmigrate`` prints them tidily."""
    return [statement.strip() for statement in by_vendor.get(schema_editor.connection.vendor, [])]
