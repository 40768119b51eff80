"""Researchers' files: one storage root per tenant on the researchers' filesystem (MooseFS
in production), the folders volumes mount, quotas and usage, and the public datasets
mounted read-only at /pub.

- `storage`: roots, folders, no-follow walks, mount checks, quotas (`mfssetquota`), usage.
- `pub`: datasets an operator publishes, copied without following a link.

Layer: files, beside events; uses models and base.
"""
