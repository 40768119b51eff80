"""Room on each page for the rows the accrual tick rewrites (PostgreSQL).

Every tick rewrites each running cluster's bill line of the hour, its meter, and its
account's usage day. With the table's pages half filled by inserts, the new version of a
row fits on its own page: a HOT update, which writes no index entry (a bill line has ten
indexes) and whose old version the next visit prunes. At 10,000 clusters that is most of
the rollups' cost (bench/accrual.py). Old hours' lines keep their half pages: a bill line
is one cluster-hour, a few hundred bytes, against 360 ledger entries under it.
SQLite (`make run`) has no fillfactor: nothing to do there.
"""

from django.db import migrations

TABLES = ("billing_billline", "billing_meter", "billing_usageday")


def half_full(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        for table in TABLES:
            schema_editor.execute(f"ALTER TABLE {table} SET (fillfactor = 50)")


def full(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        for table in TABLES:
            schema_editor.execute(f"ALTER TABLE {table} RESET (fillfactor)")


class Migration(migrations.Migration):
    dependencies = [("billing", "0012_ledger_transfer")]

    operations = [migrations.RunPython(half_full, full)]
