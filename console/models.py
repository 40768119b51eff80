"""Console-level state: researchers' personal API tokens and preferences."""

import hashlib
import secrets

from django.conf import settings
from django.db import models
from django.utils import timezone

PREFIX = "sk_suanli_"


def digest_of(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class ApiToken(models.Model):
    """A bearer token for /api/v1/. Only its SHA-256 is stored: the token is shown once."""

    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_tokens"
    )
    name = models.CharField(max_length=60)
    prefix = models.CharField(
        max_length=20, help_text="The first characters, to tell tokens apart."
    )
    digest = models.CharField(max_length=64, unique=True)
    created_at = models.DateTimeField(default=timezone.now)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"{self.name} ({self.prefix}…)"

    @classmethod
    def issue(cls, *, user, name: str) -> tuple["ApiToken", str]:
        token = PREFIX + secrets.token_urlsafe(30)
        row = cls.objects.create(
            user=user, name=name, prefix=token[: len(PREFIX) + 6], digest=digest_of(token)
        )
        return row, token


class Preferences(models.Model):
    """How the console speaks to one person: language and time zone. Blank means "from the
    browser" (Accept-Language) and "the language's usual zone" (console/preferences.py)."""

    user = models.OneToOneField(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="preferences"
    )
    language = models.CharField(max_length=10, blank=True)
    time_zone = models.CharField(max_length=64, blank=True)

    class Meta:
        verbose_name_plural = "preferences"

    def __str__(self) -> str:
        return f"{self.user}: {self.language or 'browser'}, {self.time_zone or 'default'}"
