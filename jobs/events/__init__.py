"""What happened, told once: state changes several packages make (a host unhealthy, a
cluster released, preempted or requeued), the timeline entries that say so and the webhook
events they send, written in the caller's transaction.

- `timeline`: the one writer of timeline entries and state reasons (cut to the field's
  length; whether an entry is a webhook decided by `webhooks.SENT_AS`).
- `lifecycle`: the shared state changes (a host unhealthy, a cluster released or preempted).
- `outbox`: follow-up work (a dispatch, a stop, a profile summary) queued once the
  transaction commits, kept in the database until Redis took it.
- `webhooks`: signed deliveries of those events to researchers' endpoints (Standard Webhooks).
- `netguard`: outbound HTTP to a URL a researcher gave, guarded against SSRF.

Layer: events, beside files; uses models and base.
"""
