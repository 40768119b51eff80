"""Console-level state: researchers' personal API tokens and preferences."""

import hashlib
import secrets

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.exceptions import ValidationError
from django.db import models, transaction
from django.utils import timezone
from django.utils.translation import gettext as _

from jobs.tenancy.actors import Actor, is_team_principal

PREFIX = "sk_suanli_"


def digest_of(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class ApiToken(models.Model):
    """A bearer token for /api/v1/. Only its SHA-256 is stored: the token is shown once."""

    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_tokens"
    )
    # A token made acting for a team acts for it, with its maker's role at each request (a
    # removed member's token answers as one that does not exist).
    team = models.ForeignKey(
        "jobs.Team", on_delete=models.CASCADE, null=True, blank=True, related_name="+"
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
        # An operator's power, kept here for want of a model of its own (console/metrics.py).
        permissions = [("view_metrics", "Can read the Prometheus metrics (/metrics)")]

    def __str__(self) -> str:
        return f"{self.name} ({self.prefix}…)"

    @classmethod
    def issue(cls, *, user, name: str, team=None) -> tuple["ApiToken", str]:
        """A new token, unless the researcher holds SUANLI_API_TOKENS_MAX live ones already:
        the API's rate is per researcher, and a bounded number of tokens keeps what a
        stolen session can mint (and what the page lists) bounded too. The researcher's
        row is locked, so two requests at once cannot both take the last place. `team`: the
        token acts for that team (the maker must be its member now). A team's principal
        never holds a token: nobody logs in as it, and a token would be a way in."""
        if is_team_principal(user):
            raise ValidationError(_("A team cannot hold an API token."), code="team")
        if team is not None:
            Actor.for_team(user, team.pk)  # 404 unless a member now
        most = settings.SUANLI_API_TOKENS_MAX
        with transaction.atomic():
            get_user_model().objects.select_for_update().filter(pk=user.pk).first()
            if cls.objects.filter(user=user, revoked_at__isnull=True).count() >= most:
                raise ValidationError(
                    _(
                        "You hold %(most)s live tokens, the most one researcher may: revoke "
                        "one you no longer use, then create this one."
                    )
                    % {"most": most},
                    code="too_many_tokens",
                )
            token = PREFIX + secrets.token_urlsafe(30)
            row = cls.objects.create(
                user=user, team=team, name=name, prefix=token[: len(PREFIX) + 6],
                digest=digest_of(token),
            )  # fmt: skip
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
