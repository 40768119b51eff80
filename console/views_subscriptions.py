"""GPU subscriptions (订阅GPU通知), the page "GPU subscriptions": yours (what, where, state,
expires in), a form to add one ("tell me when 8 x A100 80 GB in zone-a are free", optionally
"and rent them for me" within a budget), and cancel. The rules are
jobs/pools/subscriptions.py's, with the API's words; another researcher's is 404."""

from functools import partial

from django import forms
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import Http404
from django.shortcuts import redirect, render
from django.utils import timezone
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy
from django.views.decorators.http import require_POST

from console.forms import check_funds
from jobs.base.text import duration
from jobs.models import GpuModel, GpuSubscription, Image
from jobs.placement import fleet
from jobs.pools import subscriptions
from jobs.tenancy.actors import Role

FIELDS = (
    "gpu_model", "nodes", "gpus_per_node", "zone", "expires_in_hours", "rent", "name", "image",
    "spot", "budget_per_hour",
)  # fmt: skip


class SubscriptionForm(forms.Form):
    """The fields as the page shows them; their values go to SubscriptionRequest as given
    (its checks, the API's words), whose refusals land on the fields of the same names."""

    gpu_model = forms.CharField(label=gettext_lazy("GPU model"), widget=forms.Select)
    nodes = forms.CharField(label=gettext_lazy("Nodes"), initial=1,
                            widget=forms.NumberInput(attrs={"min": 1}))  # fmt: skip
    gpus_per_node = forms.CharField(label=gettext_lazy("GPUs per node"), initial=8,
                                    widget=forms.NumberInput(attrs={"min": 1}))  # fmt: skip
    zone = forms.CharField(label=gettext_lazy("Zone"), required=False, widget=forms.Select)
    expires_in_hours = forms.CharField(
        label=gettext_lazy("Expires after (hours)"),
        initial=subscriptions.HOURS_DEFAULT,
        widget=forms.NumberInput(
            attrs={"min": subscriptions.HOURS_MIN, "max": subscriptions.HOURS_MAX}
        ),  # fmt: skip
        help_text=gettext_lazy("1 to 720 hours (30 days); it turns expired then, without a word."),
    )
    rent = forms.BooleanField(
        label=gettext_lazy("And rent them for me: create the cluster when they are free"),
        required=False,
    )
    name = forms.CharField(label=gettext_lazy("Cluster name"), required=False)
    image = forms.CharField(label=gettext_lazy("Image"), required=False, widget=forms.Select)
    spot = forms.BooleanField(label=gettext_lazy("Spot (cheaper, may be preempted)"),
                              required=False)  # fmt: skip
    budget_per_hour = forms.CharField(
        label=gettext_lazy("Budget per hour"),
        required=False,
        help_text=gettext_lazy(
            "The most the cluster may cost an hour; over it, it is not created and you are "
            "told why. Blank: no limit."
        ),
    )

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for field in self.fields.values():
            field.required = False  # the request's checks say it, once
        self.fields["gpu_model"].widget.choices = [(m.slug, m.name) for m in GpuModel.objects.all()]
        self.fields["zone"].widget.choices = [("", _("any zone"))] + [
            (z, z) for z in fleet.active_zones()
        ]
        self.fields["image"].widget.choices = [
            (i.reference, i.name or i.reference) for i in Image.objects.filter(active=True)
        ]


def _rows(owner) -> list[dict]:
    now = timezone.now()
    return [
        {
            "sub": sub,
            # Coloured as a cluster's state is: waiting as pending, fired as running.
            "badge": {"waiting": "pending", "fired": "running"}.get(sub.state, "releasing"),
            "shape": subscriptions.shape_of(sub),
            "expires_in": duration(subscriptions.expires_in(sub, now).total_seconds())
            if sub.state == GpuSubscription.State.WAITING
            else "",
        }
        for sub in subscriptions.subscriptions_of(owner)[:100]
    ]


@login_required
def subscription_list(request):
    """GET: the page (the form filled from ?gpu_model=&nodes=&gpus_per_node=&zone=, as the
    cluster form links to it); POST: add one."""
    status = 200
    actor = request.actor
    if request.method == "POST":
        actor.require(Role.MEMBER)
        form = SubscriptionForm(request.POST)
        given = {name: request.POST.get(name) for name in FIELDS}
        given["rent"] = bool(given["rent"])
        given["spot"] = bool(given["spot"])
        try:
            subscriptions.subscribe(
                subscriptions.SubscriptionRequest(
                    owner=actor.principal, created_by=actor.person, **given
                ),
                funds=partial(check_funds, actor),
            )
        except forms.ValidationError as exc:
            form.is_valid()
            for field, said in exc.message_dict.items():
                for message in said:
                    form.add_error(None if field == "__all__" else field, message)
            status = 400
        else:
            messages.success(request, _("Subscribed: you will be told once when they are free."))
            return redirect("gpu_subscriptions")
    else:
        initial = {
            name: request.GET[name]
            for name in ("gpu_model", "nodes", "gpus_per_node", "zone")
            if name in request.GET
        }
        form = SubscriptionForm(initial=initial)
    return render(
        request,
        "console/gpu_subscriptions.html",
        {
            "form": form,
            "rows": _rows(actor.principal),
            "most": subscriptions.waiting_max(),
            "heard": subscriptions.heard(actor.principal.pk),
        },  # fmt: skip
        status=status,
    )


@login_required
@require_POST
def subscription_cancel(request, subscription_id: int):
    try:
        sub = subscriptions.subscription_of(request.actor.principal, subscription_id)
    except GpuSubscription.DoesNotExist:
        raise Http404 from None
    # A team's: any member (a wish that costs nothing until it fires), never a viewer.
    request.actor.require(Role.MEMBER)
    if subscriptions.cancel(sub):
        messages.success(request, _("Subscription cancelled: it will not fire."))
    else:
        messages.info(request, _("That subscription was no longer waiting."))
    return redirect("gpu_subscriptions")
