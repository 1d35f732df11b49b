"""Create the source of the database backend's fencing tokens, above every token it ever issued.

PostgreSQL gets a real sequence: ``nextval()`` never goes backwards and is not rolled back, and it
serializes no transactions. SQLite uses the single ``TokenSequence`` row, incremented in the same
transaction as the lock row.

Tokens must never go down, even across ``migrate distlock zero`` (or ``0001``) and back: the fenced
rows of the project's tables keep the tokens they were written with, and would refuse every lease
whose token is lower. So going down records the highest token issued in
``distlock_token_high_water``, a one-row table that no migration drops, and going up starts the
source above that record and above every token in the lock table. The statements are SQL per vendor,
so ``sqlmigrate`` prints them for deploys that apply SQL only.

A database that applied the earlier ``RunPython`` version of this migration has the same sequence or
row; ``migrate`` does not run this again there, and going down runs the reverse below, which creates
the high-water table if it is missing.
"""

from django.db import migrations

from distlock.migrations._vendor_sql import VendorSQL

SEQUENCE = "distlock_token_seq"
HIGH_WATER = "distlock_token_high_water"

# One row (id 1): the highest token issued before the token source was last dropped. Never lowered.
PG_HIGH_WATER_TABLE = f"""
CREATE TABLE IF NOT EXISTS {HIGH_WATER} (id smallint PRIMARY KEY CHECK (id = 1), value bigint NOT NULL)
"""
SQLITE_HIGH_WATER_TABLE = f"""
CREATE TABLE IF NOT EXISTS {HIGH_WATER} (id integer PRIMARY KEY CHECK (id = 1), value bigint NOT NULL)
"""

# Acquisitions draw nextval() inside an INSERT into distlock_lock, which needs ROW EXCLUSIVE on it;
# SHARE ROW EXCLUSIVE, held to the end of the migration's transaction, makes them wait, so no token
# is drawn between reading the sequence and setting or dropping it.
PG_HOLD_ACQUISITIONS = "LOCK TABLE distlock_lock IN SHARE ROW EXCLUSIVE MODE"

PG_CREATE_SEQUENCE = f"CREATE SEQUENCE IF NOT EXISTS {SEQUENCE} AS bigint START 1"

# Up: the next token is above the record and the lock table's tokens (and above the sequence's own
# last value, if the sequence survived). A fresh sequence with nothing issued still starts at 1.
PG_START_ABOVE_ISSUED = f"""
SELECT setval('{SEQUENCE}', greatest(seq.last_value, issued.highest), seq.is_called OR issued.highest >= seq.last_value)
FROM {SEQUENCE} AS seq,
     (SELECT greatest((SELECT coalesce(max(token), 0) FROM distlock_lock),
                      (SELECT coalesce(max(value), 0) FROM {HIGH_WATER})) AS highest) AS issued
"""

# Down: record the last token drawn (pg_sequence_last_value() is NULL if none was, or with no
# sequence at all) or, if higher, the lock table's highest token.
PG_RECORD_HIGH_WATER = f"""
INSERT INTO {HIGH_WATER} (id, value)
SELECT 1, greatest(coalesce(pg_sequence_last_value(to_regclass('{SEQUENCE}')), 0),
                   (SELECT coalesce(max(token), 0) FROM distlock_lock))
ON CONFLICT (id) DO UPDATE SET value = greatest({HIGH_WATER}.value, excluded.value)
"""

PG_DROP_SEQUENCE = f"DROP SEQUENCE IF EXISTS {SEQUENCE}"

# Up: the row the acquire statement increments, at the record or the lock table's highest token.
# The acquire statement also keeps tokens at or above the database clock in microseconds; the record
# matters when the counter ran ahead of that clock (a clock stepped back).
SQLITE_START_ABOVE_ISSUED = f"""
INSERT INTO distlock_tokensequence (id, value)
VALUES (1, max((SELECT coalesce(max(token), 0) FROM distlock_lock),
               (SELECT coalesce(max(value), 0) FROM {HIGH_WATER})))
ON CONFLICT (id) DO UPDATE SET value = max(value, excluded.value)
"""

# Down: record the counter or, if higher, the lock table's highest token. The table of the counter
# is dropped by reversing 0001, after this.
SQLITE_RECORD_HIGH_WATER = f"""
INSERT INTO {HIGH_WATER} (id, value)
VALUES (1, max((SELECT coalesce(max(value), 0) FROM distlock_tokensequence),
               (SELECT coalesce(max(token), 0) FROM distlock_lock)))
ON CONFLICT (id) DO UPDATE SET value = max(value, excluded.value)
"""


class Migration(migrations.Migration):
    dependencies = [("distlock", "0001_initial")]

    operations = [
        VendorSQL(
            sql={
                "postgresql": [PG_HIGH_WATER_TABLE, PG_CREATE_SEQUENCE, PG_HOLD_ACQUISITIONS, PG_START_ABOVE_ISSUED],
                "sqlite": [SQLITE_HIGH_WATER_TABLE, SQLITE_START_ABOVE_ISSUED],
            },
            reverse_sql={
                "postgresql": [PG_HIGH_WATER_TABLE, PG_HOLD_ACQUISITIONS, PG_RECORD_HIGH_WATER, PG_DROP_SEQUENCE],
                "sqlite": [SQLITE_HIGH_WATER_TABLE, SQLITE_RECORD_HIGH_WATER],
            },
            description="Create the fencing-token source above every token issued (PostgreSQL, SQLite only)",
        ),
    ]
