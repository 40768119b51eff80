"""Researchers' notification channels (the page "Notifications"): webhooks, e-mail and chat
robots. Add, edit, test, rotate a webhook's secret, read the delivery log, redeliver; an
e-mail address other than the account's own is confirmed by a link e-mailed to it. Every
lookup goes through the owner: another researcher gets 404."""

import hmac
import ipaddress

from django import forms
from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import ValidationError
from django.core.validators import validate_email
from django.http import Http404
from django.shortcuts import get_object_or_404, redirect, render
from django.utils import timezone
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy
from django.views.decorators.http import require_POST

from jobs.events import netguard, webhooks
from jobs.models import WebhookAttempt, WebhookDelivery, WebhookEndpoint
from jobs.tenancy.actors import Actor, Role

SECRET_ONCE = "webhook_secret_once"  # noqa: S105 (a session key name, not a secret)
Kind = WebhookEndpoint.Kind
SIGNED_ROBOTS = (Kind.DINGTALK, Kind.FEISHU)


class EndpointForm(forms.Form):
    kind = forms.ChoiceField(  # left out: a webhook, as before channels had kinds
        label=gettext_lazy("Channel"), choices=Kind.choices, required=False, initial=Kind.WEBHOOK
    )
    url = forms.CharField(
        label=gettext_lazy("Address"),
        max_length=2000,
        help_text=gettext_lazy(
            "A webhook or robot: its https URL on a public address (redirects are not "
            "followed). E-mail: the address; one other than your account's gets a "
            "confirmation link first."
        ),
    )
    secret = forms.CharField(
        label=gettext_lazy("Robot's signing secret"),
        max_length=200,
        required=False,
        help_text=gettext_lazy(
            "DingTalk (SEC...) or Feishu, when the robot's security settings sign messages; "
            "blank: unsigned (or, when editing, unchanged)."
        ),
    )
    events = forms.MultipleChoiceField(
        label=gettext_lazy("Events"),
        choices=WebhookEndpoint.EVENTS,
        widget=forms.CheckboxSelectMultiple,
        required=True,
    )
    enabled = forms.BooleanField(required=False, initial=True, label=gettext_lazy("Enabled"))

    def __init__(self, *args, kind=None, **kwargs):
        super().__init__(*args, **kwargs)
        if kind is not None:  # an existing channel keeps its kind
            self.fields["kind"].disabled = True
            self.fields["kind"].initial = kind

    def clean(self):
        data = super().clean()
        data["kind"] = kind = data.get("kind") or Kind.WEBHOOK
        url = (data.get("url") or "").strip()
        if not url:
            return data
        if kind == Kind.EMAIL:
            try:
                validate_email(url)
            except ValidationError:
                self.add_error(
                    "url",
                    _("%(address)s is not an e-mail address (it reads like name@example.com).")
                    % {"address": url},
                )
                return data
            if not _public_mail_domain(url.rsplit("@", 1)[1]):
                self.add_error(
                    "url",
                    _(
                        "%(address)s is not an address on the internet: its part after @ "
                        "is a name with a dot, such as example.com (not localhost or an IP "
                        "address)."
                    )
                    % {"address": url},
                )
                return data
            data["url"] = url
            return data
        if kind != Kind.WEBHOOK and not url.lower().startswith("https://"):
            self.add_error(
                "url",
                _("A %(kind)s address is the https:// URL the robot's settings show.")
                % {"kind": Kind(kind).label},
            )
            return data
        try:
            netguard.check_url(url, resolve=True)
        except netguard.Refused as exc:
            self.add_error("url", str(exc))
            return data
        if data.get("secret") and kind not in SIGNED_ROBOTS:
            self.add_error("secret", _("Only DingTalk and Feishu robots take a signing secret."))
        data["url"] = url
        return data


def _public_mail_domain(domain: str) -> bool:
    """A mail domain on the internet: a name with a dot, not localhost nor an IP literal
    (`a@[10.0.0.1]`, `root@localhost` would have our mail server write to its own network)."""
    name = domain.strip().rstrip(".").lower()
    if not name or name.startswith("[") or "." not in name or name.endswith(".localhost"):
        return False
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return True
    return False


def _own_address(user, address: str) -> bool:
    return bool(user.email) and user.email.strip().lower() == address.lower()


def _endpoint(request, endpoint_id: int) -> WebhookEndpoint:
    """The channel, its owner's (a team's: 404 for another's id, 403 below admin)."""
    endpoint = get_object_or_404(WebhookEndpoint, pk=endpoint_id, owner=request.actor.principal)
    request.actor.require(Role.ADMIN)
    return endpoint


def add_channel(user, data: dict) -> tuple[WebhookEndpoint, bool]:
    """A new channel of `user` from EndpointForm's cleaned data, under the page's and the
    API's one set of limits: at most SUANLI_NOTIFY_CHANNELS_MAX channels, and an e-mail
    address other than the account's own is sent a confirmation link (at most
    CONFIRMATIONS_PER_HOUR an hour). A limit reached is ValidationError({"url": [...]}),
    nothing saved. Returns the channel (a webhook's `secret` is shown once) and whether a
    confirmation link was sent. `user` may be an Actor: the channel is its principal's, the
    address the person's own needs no confirmation, the limits are the principal's."""
    kind = data["kind"]
    secret = webhooks.new_secret() if kind == Kind.WEBHOOK else data["secret"]
    actor = Actor.of(user)
    own = kind == Kind.EMAIL and _own_address(actor.person, data["url"])
    user = actor.principal
    most = settings.SUANLI_NOTIFY_CHANNELS_MAX
    if WebhookEndpoint.objects.filter(owner=user).count() >= most:
        raise ValidationError({"url": [_(
            "You have %(most)s notification channels, the most allowed: delete one "
            "before adding another."
        ) % {"most": most}]})  # fmt: skip
    if kind == Kind.EMAIL and not own and not webhooks.may_ask_confirmation(user.pk):
        raise ValidationError({"url": [_too_many()]})
    endpoint = WebhookEndpoint.objects.create(
        owner=user, kind=kind, url=data["url"], events=data["events"],
        enabled=data["enabled"], secret=secret,
        confirmed_at=timezone.now() if own else None,
    )  # fmt: skip
    asked = kind == Kind.EMAIL and not own
    if asked:
        webhooks.ask_confirmation(endpoint)
    return endpoint, asked


def save_channel(user, endpoint: WebhookEndpoint, data: dict) -> bool:
    """`endpoint` changed to EndpointForm's cleaned data (its kind stays): a robot's secret
    left blank stays, enabling it again clears its failure, an e-mail address changed is
    confirmed again (within CONFIRMATIONS_PER_HOUR: else ValidationError, nothing saved).
    Returns whether a confirmation link was sent."""
    actor = Actor.of(user)
    user = actor.principal
    moved = data["url"] != endpoint.url
    own = endpoint.kind == Kind.EMAIL and _own_address(actor.person, data["url"])
    if endpoint.kind == Kind.EMAIL and moved and not own:
        if not webhooks.may_ask_confirmation(user.pk):
            raise ValidationError({"url": [_too_many()]})
    endpoint.url = data["url"]
    endpoint.events = data["events"]
    fields = ["url", "events", "enabled", "failing_since", "disabled_reason"]
    if endpoint.kind in SIGNED_ROBOTS and data["secret"]:
        endpoint.secret = data["secret"]
        fields.append("secret")
    if data["enabled"] and not endpoint.enabled:
        endpoint.failing_since = None
        endpoint.disabled_reason = ""
    endpoint.enabled = data["enabled"]
    if endpoint.kind == Kind.EMAIL and moved:
        endpoint.confirmed_at = timezone.now() if own else None
        endpoint.confirm_token = ""
        fields += ["confirmed_at", "confirm_token"]
    endpoint.save(update_fields=fields)
    asked = endpoint.kind == Kind.EMAIL and moved and not own
    if asked:
        webhooks.ask_confirmation(endpoint)
    return asked


def send_channel_test(user, endpoint: WebhookEndpoint) -> bool:
    """The test button: a test event to the channel (at most RESENDS_PER_HOUR test messages
    and redeliveries an hour), or to an e-mail address not confirmed yet a new confirmation
    link instead (at most CONFIRMATIONS_PER_HOUR). A limit reached is ValidationError.
    Returns whether a confirmation link was sent rather than a test."""
    user = Actor.of(user).principal
    if endpoint.kind == Kind.EMAIL and endpoint.confirmed_at is None:
        if not webhooks.may_ask_confirmation(user.pk):
            raise ValidationError(_too_many())
        webhooks.ask_confirmation(endpoint)
        return True
    if not webhooks.may_resend(user.pk):
        raise ValidationError(_too_many_resends())
    webhooks.send_test(endpoint)
    return False


def not_confirmed_words(endpoint: WebhookEndpoint) -> str:
    return _("%(address)s is not confirmed yet: a new confirmation link is on its way.") % {
        "address": endpoint.url
    }


def _list_page(request, form):
    endpoints = WebhookEndpoint.objects.filter(owner=request.actor.principal)
    return render(request, "console/webhooks.html", {"form": form, "endpoints": endpoints})


@login_required
def endpoint_list(request):
    # A team's channels carry its robots' addresses (secrets): its admins and owner only.
    request.actor.require(Role.ADMIN)
    form = EndpointForm(request.POST or None, initial={"enabled": True})
    if request.method == "POST" and form.is_valid():
        try:
            endpoint, asked = add_channel(request.actor, form.cleaned_data)
        except ValidationError as exc:
            for words in exc.message_dict["url"]:
                form.add_error("url", words)
            return _list_page(request, form)
        if endpoint.kind == Kind.WEBHOOK:
            request.session[SECRET_ONCE] = {"id": endpoint.pk, "secret": endpoint.secret}
            messages.success(
                request, _("Endpoint added. Copy its signing secret now: it is shown once.")
            )
        elif asked:
            messages.success(request, _confirm_sent(endpoint))
        else:
            messages.success(request, _("Channel added. Send a test message to try it."))
        return redirect("webhook_detail", endpoint.pk)
    return _list_page(request, form)


def _too_many() -> str:
    return _(
        "%(count)s confirmation links were sent in the last hour: wait a while before "
        "asking for another."
    ) % {"count": webhooks.CONFIRMATIONS_PER_HOUR}


def _too_many_resends() -> str:
    return _(
        "%(count)s test messages and redeliveries were sent in the last hour: wait a while "
        "before sending another."
    ) % {"count": webhooks.RESENDS_PER_HOUR}


def _confirm_sent(endpoint) -> str:
    return _(
        "A confirmation link is on its way to %(address)s; nothing else is sent there "
        "until it is opened."
    ) % {"address": endpoint.url}


@login_required
def endpoint_detail(request, endpoint_id: int):
    """Long because it is the channel's page: its settings form (an e-mail address changed is
    confirmed again), the secret shown once, and the delivery log with each attempt."""
    endpoint = _endpoint(request, endpoint_id)
    form = EndpointForm(
        request.POST or None,
        kind=endpoint.kind,
        initial={"url": endpoint.url, "events": endpoint.events, "enabled": endpoint.enabled},
    )
    if request.method == "POST" and form.is_valid():
        try:
            asked = save_channel(request.actor, endpoint, form.cleaned_data)
        except ValidationError as exc:
            messages.error(request, " ".join(exc.messages))
            return redirect("webhook_detail", endpoint.pk)
        if asked:
            messages.success(request, _confirm_sent(endpoint))
        else:
            messages.success(request, _("Channel saved."))
        return redirect("webhook_detail", endpoint.pk)
    once = request.session.pop(SECRET_ONCE, None)
    secret = once["secret"] if once and once.get("id") == endpoint.pk else None
    deliveries = list(
        WebhookDelivery.objects.filter(endpoint=endpoint).select_related("event")[:50]
    )
    attempts = {}
    for attempt in WebhookAttempt.objects.filter(delivery__in=deliveries).order_by("at"):
        attempts.setdefault(attempt.delivery_id, []).append(attempt)
    rows = [
        (d, webhooks.LABELS.get(d.event.type, d.event.type), webhooks.words(d.event),
         attempts.get(d.pk, []))
        for d in deliveries
    ]  # fmt: skip
    return render(
        request,
        "console/webhook_detail.html",
        {"endpoint": endpoint, "form": form, "secret": secret, "rows": rows},
    )


@login_required
@require_POST
def endpoint_test(request, endpoint_id: int):
    endpoint = _endpoint(request, endpoint_id)
    try:
        asked = send_channel_test(request.actor, endpoint)
    except ValidationError as exc:
        messages.error(request, " ".join(exc.messages))
        return redirect("webhook_detail", endpoint.pk)
    if asked:
        messages.error(request, not_confirmed_words(endpoint))
    else:
        messages.success(request, _("A test event is on its way; its attempts show below."))
    return redirect("webhook_detail", endpoint.pk)


@login_required
@require_POST
def endpoint_rotate(request, endpoint_id: int):
    endpoint = _endpoint(request, endpoint_id)
    if endpoint.kind != Kind.WEBHOOK:
        raise Http404("only a webhook has a secret of ours")
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
    messages.success(request, _("Channel %(url)s deleted.") % {"url": endpoint.url})
    return redirect("webhooks")


@login_required
@require_POST
def delivery_redeliver(request, delivery_id: int):
    delivery = get_object_or_404(
        WebhookDelivery, pk=delivery_id, endpoint__owner=request.actor.principal
    )
    request.actor.require(Role.ADMIN)
    if delivery.event.type == webhooks.CONFIRM_EVENT:
        messages.error(
            request,
            _(
                'A confirmation link is not sent again: "Send test message" sends a new '
                "one (at most %(count)s an hour)."
            )
            % {"count": webhooks.CONFIRMATIONS_PER_HOUR},
        )
        return redirect("webhook_detail", delivery.endpoint_id)
    if not webhooks.may_resend(request.actor.principal.pk):
        messages.error(request, _too_many_resends())
        return redirect("webhook_detail", delivery.endpoint_id)
    webhooks.redeliver(delivery)
    messages.success(
        request,
        _("%(event)s queued again (same webhook-id).") % {"event": delivery.event.type},
    )
    return redirect("webhook_detail", delivery.endpoint_id)


def _confirm_page(endpoint, *, done: bool) -> dict:
    return {"address": endpoint.url, "done": done, "title": _("Notifications by e-mail")}


def confirm_address(request, endpoint_id: int, token: str):
    """The link e-mailed to a new address: a page with one button (mail scanners that open
    links do not confirm), its POST confirms. No sign-in: whoever reads that mailbox may."""
    endpoint = WebhookEndpoint.objects.filter(pk=endpoint_id, kind=Kind.EMAIL).first()
    if endpoint is None or not endpoint.confirm_token:
        raise Http404("no such confirmation")
    if request.method == "POST":
        if webhooks.confirm(endpoint_id, token) is None:
            raise Http404("no such confirmation")
        return render(request, "console/notify_confirm.html", _confirm_page(endpoint, done=True))
    if not hmac.compare_digest(endpoint.confirm_token.encode(), token.encode()):
        raise Http404("no such confirmation")
    return render(request, "console/notify_confirm.html", _confirm_page(endpoint, done=False))
