"""Set-based writes that the ORM spells slowly.

Django's `bulk_update` builds one `CASE WHEN pk = ... THEN ...` expression per row and
field, resolved in Python: about 2 ms a row on this machine. One `UPDATE ... FROM (VALUES
...)` per chunk does the same in one statement whose SQL is a plain string.

Layer: base (beside queue and outage); uses no other part (models are passed in).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence

from django.db import connection, models
from django.db.models.lookups import In

CHUNK = 2000


def update_rows(model: type[models.Model], key: str, fields: Sequence[str], rows: Iterable[tuple]):
    """`UPDATE model SET field = v ... WHERE key = v` for each row `(key, *fields)` in one
    statement (a chunk at a time on SQLite). Column names come from the model, never
    from input; values are bound parameters. The caller holds the rows' locks."""
    rows = list(rows)
    if not rows:
        return 0
    opts = model._meta
    qn = connection.ops.quote_name
    table = qn(opts.db_table)
    db_fields = [opts.get_field(name) for name in (key, *fields)]
    columns = [qn(f.column) for f in db_fields]
    assignments = ", ".join(f"{col} = v.{col}" for col in columns[1:])
    updated = 0
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            # One array a column: the statement's text stays the same size however many
            # rows, and psycopg adapts the values in C.
            arrays = ", ".join(f"%s::{f.cast_db_type(connection)}[]" for f in db_fields)
            values = [list(column) for column in zip(*rows, strict=True)]
            for i, f in enumerate(db_fields):
                if f.get_internal_type() == "JSONField":  # as its text, cast by the array's type
                    values[i] = [
                        None if v is None else json.dumps(v, cls=f.encoder) for v in values[i]
                    ]
            cursor.execute(
                f"UPDATE {table} SET {assignments} FROM unnest({arrays}) "  # noqa: S608 (names from the model; values bound)
                f"AS v({', '.join(columns)}) WHERE {table}.{columns[0]} = v.{columns[0]}",
                values,
            )
            return cursor.rowcount
        for start in range(0, len(rows), CHUNK):
            chunk = rows[start : start + CHUNK]
            row = "(" + ", ".join(["%s"] * len(columns)) + ")"
            params = [
                f.get_db_prep_save(v, connection)
                for values in chunk
                for f, v in zip(db_fields, values, strict=True)
            ]
            # VALUES columns are column1, column2, ... in SQLite; name them by position.
            sets = ", ".join(f"{col} = v.column{i + 2}" for i, col in enumerate(columns[1:]))
            cursor.execute(
                f"UPDATE {table} SET {sets} FROM (VALUES {', '.join([row] * len(chunk))}) AS v "  # noqa: S608 (names from the model; values bound)
                f"WHERE {table}.{columns[0]} = v.column1",
                params,
            )
            updated += cursor.rowcount
    return updated


def insert_rows(model: type[models.Model], fields: Sequence[str], rows: Iterable[tuple]) -> int:
    """INSERT plain tuples (in the order of `fields`) without building model instances: one
    COPY on PostgreSQL, a prepared multi-row INSERT elsewhere. No defaults are filled in and
    no signals sent: the caller gives every column that has no database default. A unique
    violation raises IntegrityError and the caller's transaction rolls back whole."""
    rows = list(rows)
    if not rows:
        return 0
    opts = model._meta
    qn = connection.ops.quote_name
    db_fields = [opts.get_field(name) for name in fields]
    table = qn(opts.db_table)
    columns = ", ".join(qn(f.column) for f in db_fields)
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            # COPY takes Python values as they are, except JSON: written as its text.
            json_at = [i for i, f in enumerate(db_fields) if f.get_internal_type() == "JSONField"]
            with (
                connection.wrap_database_errors,
                cursor.copy(
                    f"COPY {table} ({columns}) FROM STDIN"  # names from the model
                ) as copy,
            ):
                for row in rows:
                    if json_at:
                        row = list(row)
                        for i in json_at:
                            row[i] = json.dumps(row[i], cls=db_fields[i].encoder)
                    copy.write_row(row)
        else:
            marks = ", ".join(["%s"] * len(db_fields))
            cursor.executemany(
                f"INSERT INTO {table} ({columns}) VALUES ({marks})",  # noqa: S608 (names from the model; values bound)
                [
                    [f.get_db_prep_save(v, connection) for f, v in zip(db_fields, row, strict=True)]
                    for row in rows
                ],
            )
    return len(rows)


class AnyOf(In):
    """`field IN values` as a lookup expression (`.filter(AnyOf(F("cluster_id"), ids))`):
    on PostgreSQL `field = ANY(%s)`, one array parameter however many values. An IN of
    2,000 placeholders costs the client-side binding ~20 ms to split (psycopg
    `_split_query`) on every statement; the array is adapted in C. Elsewhere, IN."""

    def as_postgresql(self, compiler, connection):
        lhs, params = self.process_lhs(compiler, connection)
        field = self.lhs.output_field
        values = [field.get_db_prep_value(v, connection) for v in self.rhs if v is not None]
        return f"{lhs} = ANY(%s::{field.cast_db_type(connection)}[])", (*params, values)
