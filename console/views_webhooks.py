"""Researchers' webhook endpoints: add, edit, test, rotate the secret, read the delivery
log, redeliver. Every lookup goes through the owner: another researcher gets 404."""

from django import forms
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import ValidationError
from django.shortcuts import get_object_or_404, redirect, render
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy
from django.views.decorators.http import require_POST

from jobs.events import netguard, webhooks
from jobs.models import WebhookAttempt, WebhookDelivery, WebhookEndpoint

SECRET_ONCE = "webhook_secret_once"  # noqa: S105 (a session key name, not a secret)


class EndpointForm(forms.Form):
    url = forms.CharField(
        label=gettext_lazy("URL"),
        max_length=2000,
        help_text=gettext_lazy("http(s) on a public address; redirects are not followed."),
    )
    events = forms.MultipleChoiceField(
        label=gettext_lazy("Events"),
        choices=WebhookEndpoint.EVENTS,
        widget=forms.CheckboxSelectMultiple,
        required=True,
    )
    enabled = forms.BooleanField(required=False, initial=True, label=gettext_lazy("Enabled"))

    def clean_url(self):
        url = self.cleaned_data["url"].strip()
        try:
            netguard.check_url(url, resolve=True)
        except netguard.Refused as exc:
            raise ValidationError(str(exc)) from None
        return url


def _endpoint(request, endpoint_id: int) -> WebhookEndpoint:
    return get_object_or_404(WebhookEndpoint, pk=endpoint_id, owner=request.user)


@login_required
def endpoint_list(request):
    form = EndpointForm(request.POST or None, initial={"enabled": True})
    if request.method == "POST" and form.is_valid():
        secret = webhooks.new_secret()
        endpoint = WebhookEndpoint.objects.create(
            owner=request.user, url=form.cleaned_data["url"], events=form.cleaned_data["events"],
            enabled=form.cleaned_data["enabled"], secret=secret,
        )  # fmt: skip
        request.session[SECRET_ONCE] = {"id": endpoint.pk, "secret": secret}
        messages.success(
            request, _("Endpoint added. Copy its signing secret now: it is shown once.")
        )
        return redirect("webhook_detail", endpoint.pk)
    endpoints = WebhookEndpoint.objects.filter(owner=request.user)
    return render(request, "console/webhooks.html", {"form": form, "endpoints": endpoints})


@login_required
def endpoint_detail(request, endpoint_id: int):
    endpoint = _endpoint(request, endpoint_id)
    form = EndpointForm(
        request.POST or None,
        initial={"url": endpoint.url, "events": endpoint.events, "enabled": endpoint.enabled},
    )
    if request.method == "POST" and form.is_valid():
        endpoint.url = form.cleaned_data["url"]
        endpoint.events = form.cleaned_data["events"]
        if form.cleaned_data["enabled"] and not endpoint.enabled:
            endpoint.failing_since = None
            endpoint.disabled_reason = ""
        endpoint.enabled = form.cleaned_data["enabled"]
        endpoint.save(
            update_fields=["url", "events", "enabled", "failing_since", "disabled_reason"]
        )
        messages.success(request, _("Endpoint saved."))
        return redirect("webhook_detail", endpoint.pk)
    once = request.session.pop(SECRET_ONCE, None)
    secret = once["secret"] if once and once.get("id") == endpoint.pk else None
    deliveries = WebhookDelivery.objects.filter(endpoint=endpoint).select_related("event")[:50]
    attempts = {}
    for attempt in WebhookAttempt.objects.filter(delivery__in=deliveries).order_by("at"):
        attempts.setdefault(attempt.delivery_id, []).append(attempt)
    rows = [(d, attempts.get(d.pk, [])) for d in deliveries]
    return render(
        request,
        "console/webhook_detail.html",
        {"endpoint": endpoint, "form": form, "secret": secret, "rows": rows},
    )


@login_required
@require_POST
def endpoint_test(request, endpoint_id: int):
    endpoint = _endpoint(request, endpoint_id)
    webhooks.send_test(endpoint)
    messages.success(request, _("A test event is on its way; its attempts show below."))
    return redirect("webhook_detail", endpoint.pk)


@login_required
@require_POST
def endpoint_rotate(request, endpoint_id: int):
    endpoint = _endpoint(request, endpoint_id)
    secret = webhooks.rotate(endpoint)
    request.session[SECRET_ONCE] = {"id": endpoint.pk, "secret": secret}
    messages.success(
        request, _("New secret made. The old one keeps signing beside it for 24 hours.")
    )
    return redirect("webhook_detail", endpoint.pk)


@login_required
@require_POST
def endpoint_delete(request, endpoint_id: int):
    endpoint = _endpoint(request, endpoint_id)
    endpoint.delete()
    messages.success(request, _("Endpoint %(url)s deleted.") % {"url": endpoint.url})
    return redirect("webhooks")


@login_required
@require_POST
def delivery_redeliver(request, delivery_id: int):
    delivery = get_object_or_404(WebhookDelivery, pk=delivery_id, endpoint__owner=request.user)
    webhooks.redeliver(delivery)
    messages.success(
        request,
        _("%(event)s queued again (same webhook-id).") % {"event": delivery.event.type},
    )
    return redirect("webhook_detail", delivery.endpoint_id)
