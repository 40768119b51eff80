"""The console's verbs on clusters and jobs: created, resized, stopped, started, released;
jobs submitted and cancelled; SSH keys (`services`). Keyword-only, atomic where they span rows.
A job is started or stopped by task name (jobs.base.queue), never by importing runs.

Layer: clusters, beside hosts; uses nodes, placement, events, files, models and base.
"""
