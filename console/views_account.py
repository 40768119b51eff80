"""The language switch of the navigation and the settings page (language, time zone, and
below how many hours of balance left the researcher is warned)."""

from django import forms
from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.db import transaction
from django.http import HttpResponseRedirect
from django.shortcuts import redirect, render
from django.urls import reverse
from django.utils import translation
from django.utils.http import url_has_allowed_host_and_scheme
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy
from django.views.decorators.http import require_POST

from billing import selectors as billing_selectors
from billing import services as billing_services
from billing.models import WARN_HOURS_MAX, WARN_HOURS_MIN, Account
from console import preferences


def _back(request) -> str:
    target = request.POST.get("next") or request.headers.get("Referer") or ""
    if url_has_allowed_host_and_scheme(
        target, allowed_hosts={request.get_host()}, require_https=request.is_secure()
    ):
        return target
    return reverse("dashboard")


def _remember(response, language: str) -> None:
    """The language cookie (LocaleMiddleware reads it before anyone signs in)."""
    if not language:
        response.delete_cookie(settings.LANGUAGE_COOKIE_NAME)
        return
    response.set_cookie(
        settings.LANGUAGE_COOKIE_NAME,
        language,
        max_age=settings.LANGUAGE_COOKIE_AGE,
        secure=settings.LANGUAGE_COOKIE_SECURE,
        samesite=settings.LANGUAGE_COOKIE_SAMESITE,
        httponly=True,
    )


@require_POST
def set_language(request):
    """The navigation's switch: kept on the person (every later sign-in) and in a cookie
    (the login page before it)."""
    language = request.POST.get("language", "")
    response = HttpResponseRedirect(_back(request))
    if language not in preferences.languages():
        return response
    if request.user.is_authenticated:
        preferences.save(request.user, language=language)
    _remember(response, language)
    return response


class PreferencesForm(forms.Form):
    language = forms.ChoiceField(label=gettext_lazy("Language"), required=False)
    time_zone = forms.ChoiceField(
        label=gettext_lazy("Time zone"),
        required=False,
        help_text=gettext_lazy(
            "Every date and time in the console is shown in this zone. Billing hours stay "
            "whole hours of UTC."
        ),
    )

    # Kept on the researcher's account (billing decides when to warn): billing.services.
    low_balance_hours = forms.DecimalField(
        label=gettext_lazy("Warn me when my balance lasts less than (hours)"),
        required=False,
        max_digits=5,
        decimal_places=2,
        min_value=WARN_HOURS_MIN,
        max_value=WARN_HOURS_MAX,
        widget=forms.NumberInput(attrs={"inputmode": "decimal"}),
    )

    def __init__(self, *args, language: str, **kwargs):
        super().__init__(*args, **kwargs)
        refusal = billing_services.warn_hours_refusal()
        field = self.fields["low_balance_hours"]
        for code in ("invalid", "min_value", "max_value", "max_digits", "max_decimal_places"):
            field.error_messages[code] = refusal
        default = billing_selectors.warn_hours_default()
        field.widget.attrs["placeholder"] = f"{default:f}"
        field.help_text = _(
            "At the rate your clusters cost now: a warning on every page and to your "
            "notification channels (balance.low), another at 30 minutes left "
            "(balance.critical). Empty: %(default)s h, the usual."
        ) % {"default": f"{default:f}"}
        self.fields["language"].choices = [("", _("As the browser asks"))] + [
            (code, name) for code, name in settings.LANGUAGES
        ]
        self.fields["time_zone"].choices = [
            (
                "",
                _("Usual for the language (%(zone)s)")
                % {"zone": preferences.default_zone(language)},
            )
        ] + [(z, z.replace("_", " ")) for z in preferences.zone_choices(language)]


@login_required
def account_settings(request):
    prefs = preferences.of(request.user)
    initial = {"language": prefs.language, "time_zone": prefs.time_zone} if prefs else {}
    initial["low_balance_hours"] = (
        Account.objects.filter(user=request.user)
        .values_list("low_balance_hours", flat=True)
        .first()
    )
    language = translation.get_language()
    form = PreferencesForm(request.POST or None, initial=initial, language=language)
    if request.method == "POST" and form.is_valid():
        chosen = form.cleaned_data["language"]
        with transaction.atomic():  # all of it or nothing
            preferences.save(
                request.user, language=chosen, time_zone=form.cleaned_data["time_zone"]
            )
            billing_services.set_low_balance_hours(
                request.user, form.cleaned_data["low_balance_hours"]
            )
        if chosen:
            translation.activate(chosen)
        messages.success(request, _("Settings saved."))
        response = redirect("account_settings")
        _remember(response, chosen)
        return response
    return render(request, "console/account_settings.html", {"form": form})
