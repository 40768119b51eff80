"""Secrets at rest: a text field that PostgreSQL only ever sees encrypted.

Webhook signing secrets and the engines' TLS material are written as Fernet tokens
(AES-128-CBC with an HMAC-SHA256, from `cryptography`) under the key(s) in
`settings.SUANLI_SECRETS_KEYS` (from `SUANLI_SECRETS_KEY` or `SUANLI_SECRETS_KEY_FILE`; see
console/settings.py). A database dump, a replica or a backup alone does not give them away.

Several keys (comma-separated) rotate: the first encrypts, every one decrypts. Rows written
before encryption (plain text, without the prefix) are still read, so the data migration
that encrypts them can run on a live table; it leaves none behind.

This module is the lowest layer: jobs and billing models may both use it.

Layer: base, the bottom of jobs/; uses no other part.
"""

from __future__ import annotations

import functools

from cryptography.fernet import Fernet, InvalidToken, MultiFernet
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db import models

PREFIX = "fernet:"


@functools.cache
def _fernet(keys: tuple[str, ...]) -> MultiFernet:
    try:
        return MultiFernet([Fernet(key.encode()) for key in keys])
    except ValueError:
        raise ImproperlyConfigured(
            "SUANLI_SECRETS_KEY must be Fernet keys (32 url-safe base64-encoded bytes), "
            "comma-separated; make one with: python -c 'from cryptography.fernet import Fernet; "
            "print(Fernet.generate_key().decode())'"
        ) from None


def fernet() -> MultiFernet:
    return _fernet(tuple(settings.SUANLI_SECRETS_KEYS))


def encrypt(plain: str) -> str:
    """The stored form of a secret; the empty string stays empty (nothing to hide)."""
    if not plain:
        return plain
    return PREFIX + fernet().encrypt(plain.encode()).decode()


def decrypt(stored: str) -> str:
    if not stored or not stored.startswith(PREFIX):
        return stored  # empty, or written before encryption (the migration encrypts it)
    try:
        return fernet().decrypt(stored.removeprefix(PREFIX).encode()).decode()
    except InvalidToken:
        raise ImproperlyConfigured(
            "A stored secret does not decrypt with SUANLI_SECRETS_KEY: the key changed without "
            "keeping the old one (list it after the new one, comma-separated)."
        ) from None


def is_encrypted(stored: str) -> bool:
    return bool(stored) and stored.startswith(PREFIX)


class EncryptedTextField(models.TextField):
    """Text stored encrypted; Python code reads and writes the plain value.

    Encryption is randomised, so the database cannot compare values: only `isnull` can
    be filtered on (any other lookup raises FieldError instead of silently matching
    nothing)."""

    def from_db_value(self, value, expression, connection):
        return value if value is None else decrypt(value)

    def get_db_prep_save(self, value, connection):
        value = super().get_db_prep_save(value, connection)
        return value if value is None else encrypt(value)

    def get_lookup(self, lookup_name):
        return super().get_lookup(lookup_name) if lookup_name == "isnull" else None
