"""A database ENGINE that says it is MySQL, for system checks that read only ``connection.vendor`` (no I/O)."""

from django.db.backends.sqlite3.base import DatabaseWrapper as SQLiteDatabaseWrapper


class DatabaseWrapper(SQLiteDatabaseWrapper):
    vendor = "mysql"
