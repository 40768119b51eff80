"""GPU availability subscriptions (订阅GPU通知): "tell me when 8 x A100 80 GB in zone-a are
free", optionally "and rent them for me" within a budget per hour.

`subscribe` checks a request (the GPU shape by the cluster spec's own rules, the expiry, the
budget, the cap on waiting subscriptions, and the cluster request to rent) and saves it, or
refuses it whole with a ValidationError keyed by field. `check` is the cron tick's and the
after-GPUs-came-back check: waiting subscriptions past their time turn expired (nothing
said), and each other whose shape placement would place now (capacity.Fleet.plan on the free
capacity, behind the pending clusters' claim: one rule) fires once: a conditional UPDATE of
its state and `fired_at` in the transaction that emits `gpu.available` and, with rent,
creates the cluster through the one cluster service (the balance and the budget checked
then; a refusal is said in the event).

The balance is asked through `funds=` / `funds_of=` (console.forms.check_funds), since billing
sits above jobs; `check` runs from console/subscriptions.py.

A team's subscription rents as the member who made it (`created_by`, `renter`): the team's
balance, that member's caps (budget, GPUs), the cluster theirs (`Cluster.created_by`), and
only while they are still a member or above; else renting is refused in words. A member who
leaves or is removed has their waiting ones cancelled (GpuSubscription.cancel_waiting_of).

Layer: pools (above clusters: it may create clusters); uses clusters (spec, services),
placement (capacity, fleet), events (webhooks), tenancy (actors), models and base.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import timedelta
from decimal import Decimal, InvalidOperation
from typing import Any

from django import forms
from django.conf import settings
from django.core.exceptions import NON_FIELD_ERRORS, ValidationError
from django.db import transaction
from django.utils import timezone, translation
from django.utils.translation import gettext as _
from django.utils.translation import gettext_noop

from jobs.base.text import Text, show
from jobs.clusters import services
from jobs.clusters.spec import (
    CUSTOM,
    NAME_MAX,
    SHORT_BALANCE,
    ClusterRequest,
    FundsCheck,
    Offer,
    image_by_reference,
)
from jobs.events import webhooks
from jobs.models import MAX_GPUS_PER_HOST, Cluster, GpuModel, GpuSubscription, TeamMember
from jobs.placement import fleet as fleet_reads
from jobs.placement.capacity import Fleet
from jobs.tenancy.actors import Actor, is_team_principal

log = logging.getLogger(__name__)

HOURS_MIN = 1
HOURS_MAX = 30 * 24
HOURS_DEFAULT = 24
EVENT = "gpu.available"
# The fields of a request to rent, as the API and the form name them.
RENT_FIELDS = ("name", "image", "spot", "ssh_keys")


def waiting_max() -> int:
    return settings.SUANLI_GPU_SUBSCRIPTIONS_MAX


def shape_of(sub: GpuSubscription) -> str:
    """ "8 × A100 80 GB" (one node), "2 × 8 × A100 80 GB" (nodes × GPUs per node)."""
    if sub.nodes == 1:
        return f"{sub.gpus_per_node} × {sub.gpu_model.name}"
    return f"{sub.nodes} × {sub.gpus_per_node} × {sub.gpu_model.name}"


def subscriptions_of(owner):
    return GpuSubscription.objects.filter(owner=owner).select_related("gpu_model", "cluster")


def subscription_of(owner, pk) -> GpuSubscription:
    """The owner's subscription; another's (or none) is GpuSubscription.DoesNotExist."""
    return subscriptions_of(owner).get(pk=pk)


class _Priced:
    """A balance answer that is never short: at subscribing, renting is later (a top-up
    may come first); only the price matters now."""

    short = False

    def __init__(self, answer):
        self.answer = answer

    def refusal(self, message: str, **extra) -> str:  # pragma: no cover - never short
        return self.answer.refusal(message, **extra)

    def as_context(self) -> dict:  # pragma: no cover - never short
        return self.answer.as_context()


@dataclass
class SubscriptionRequest:
    """A subscription as asked for (the form's or the API's fields, unparsed). Fields:
    gpu_model (a slug), nodes, gpus_per_node, zone ("" any), expires_in_hours, and to rent:
    rent (bool), name, image (a reference, as the API takes it), spot, ssh_keys (ids; None:
    the owner's default keys), budget_per_hour (blank: no limit). `created_by`: the person
    asking (a team's member; default the owner)."""

    owner: Any
    created_by: Any = None
    gpu_model: Any = None
    nodes: Any = 1
    gpus_per_node: Any = None
    zone: Any = ""
    expires_in_hours: Any = HOURS_DEFAULT
    rent: bool = False
    name: Any = None
    image: Any = None
    spot: bool = False
    ssh_keys: Any = None
    budget_per_hour: Any = None
    _errors: dict[str, list] = field(default_factory=dict, init=False, repr=False)

    def _refuse(self, name: str, message) -> None:
        self._errors.setdefault(name, []).append(message)

    def _clean(self, name: str, check: forms.Field, value):
        try:
            return check.clean(value)
        except ValidationError as exc:
            for message in exc.messages:
                self._refuse(name, message)
            return None

    def validate(self, *, funds: FundsCheck) -> dict:
        """The fields of a GpuSubscription, or ValidationError (messages by field)."""
        self._errors = {}
        models = {m.slug: m for m in GpuModel.objects.all()}
        slug = self._clean("gpu_model", forms.CharField(), self.gpu_model)
        gpu_model = models.get(slug) if slug else None
        if slug and gpu_model is None:
            self._refuse(
                "gpu_model",
                _("Unknown GPU model %(model)s; choose one of: %(models)s.")
                % {"model": slug, "models": ", ".join(sorted(models))},
            )
        nodes = self._clean(
            "nodes",
            forms.IntegerField(min_value=1, max_value=settings.SUANLI_MAX_NODES),
            self.nodes,
        )
        gpus = self._clean(
            "gpus_per_node",
            forms.IntegerField(min_value=1, max_value=MAX_GPUS_PER_HOST),
            self.gpus_per_node,
        )
        zone = self._clean("zone", forms.CharField(required=False, max_length=40), self.zone)
        hours = self._clean(
            "expires_in_hours",
            forms.IntegerField(min_value=HOURS_MIN, max_value=HOURS_MAX),
            HOURS_DEFAULT if self.expires_in_hours in (None, "") else self.expires_in_hours,
        )
        budget = self._budget()
        rent = self._rent_fields() if self.rent else None
        if gpu_model is not None and nodes and gpus and "zone" not in self._errors:
            self._shape(gpu_model, nodes, gpus, zone or "", rent, budget, funds)
        if (
            GpuSubscription.objects.filter(
                owner=self.owner, state=GpuSubscription.State.WAITING
            ).count()
            >= waiting_max()
        ):
            self._refuse(
                NON_FIELD_ERRORS,
                _(
                    "You have %(most)s waiting GPU subscriptions, the most allowed: cancel "
                    "one first."
                )
                % {"most": waiting_max()},
            )
        elif GpuSubscription.objects.filter(
            owner=self.owner, created_at__gte=timezone.now() - timedelta(days=1)
        ).count() >= (per_day := settings.SUANLI_GPU_SUBSCRIPTIONS_PER_DAY):
            self._refuse(  # a subscribe-then-cancel loop would add rows without end
                NON_FIELD_ERRORS,
                _(
                    "You made %(most)s GPU subscriptions in the last 24 hours, the most "
                    "allowed: wait a while before making another."
                )
                % {"most": per_day},
            )
        if self._errors:
            raise ValidationError(self._errors)
        now = timezone.now()
        return {
            "owner": self.owner,
            "created_by": self.created_by or self.owner,
            "gpu_model": gpu_model,
            "nodes": nodes,
            "gpus_per_node": gpus,
            "zone": zone or "",
            "created_at": now,
            "expires_at": now + timedelta(hours=hours),
            "rent": rent,
            "budget_per_hour": budget if rent is not None else None,
        }

    def _budget(self) -> Decimal | None:
        if self.budget_per_hour in (None, ""):
            return None
        try:
            budget = Decimal(str(self.budget_per_hour).strip())
        except InvalidOperation:
            self._refuse("budget_per_hour", _("Enter a number."))
            return None
        if not budget.is_finite() or budget < 0:
            self._refuse(
                "budget_per_hour", _("The budget per hour is an amount of 0 or more, e.g. 30.00.")
            )
            return None
        if budget.as_tuple().exponent < -4 or budget >= Decimal(10) ** 12:
            self._refuse(
                "budget_per_hour",
                _("The budget per hour has at most 4 decimal places and 12 digits."),
            )
            return None
        return budget

    def _rent_fields(self) -> dict:
        """The cluster request to save, as the API would send it (checked in `_shape`)."""
        name = self._clean("name", forms.CharField(max_length=NAME_MAX), self.name)
        image = self._clean("image", forms.CharField(max_length=255), self.image)
        keys = self.ssh_keys
        if keys is None:
            keys = [k.pk for k in services.ssh_keys_default(self.owner)]
        return {
            "name": name or "",
            "image": (image or "").strip(),
            "spot": bool(self.spot),
            "ssh_keys": [str(k) for k in keys],
        }

    def _shape(self, gpu_model, nodes, gpus, zone, rent, budget, funds: FundsCheck) -> None:
        """The cluster spec's rules on the shape (could the hosts ever hold it, in that
        zone) and, to rent, on the whole request; the price against the budget."""
        prices = []

        def priced(**kwargs):
            if rent is None:
                return _Priced(None)  # a notification has no price
            answer = funds(**kwargs)
            if answer is None:
                return None
            prices.append(answer)
            return _Priced(answer)

        request = cluster_request(
            self.owner, gpu_model=gpu_model, nodes=nodes, gpus_per_node=gpus, zone=zone,
            rent=rent or {"name": "x"},
        )  # fmt: skip
        if rent is None:  # only the shape: no name, no image to check
            request.parsed = True
            request.refused = frozenset({"name", "image", "custom_image"})
        checked = request.check(Offer.of(self.owner), funds=priced)
        for name, messages in checked.errors.items():
            key = {"resource": "gpu_model", "custom_image": "image", "network": "zone"}.get(
                name, name
            )
            if rent is None and key not in ("gpu_model", "nodes", "gpus_per_node", "zone"):
                continue  # the price: said when renting only
            for message in messages:
                for text in ValidationError(message).messages:
                    self._refuse(key, text)
        if rent is not None and budget is not None and prices:
            if prices[0].per_hour > budget:
                self._refuse("budget_per_hour", over_budget(prices[0], budget))


def money(answer, amount: Decimal) -> str:
    """`amount` written as the balance answer writes money ("¥30.0000")."""
    return replace(answer, per_hour=amount.quantize(Decimal("0.0001"))).refusal("%(per_hour)s")


OVER_BUDGET = gettext_noop("These GPUs cost %(per_hour)s/h, over your budget of %(budget)s/h.")


def over_budget(answer, budget: Decimal) -> str:
    return answer.refusal(_(OVER_BUDGET), budget=money(answer, budget))


def _amounts(answer) -> dict[str, str | int]:
    """The balance answer's amounts as its refusals write them, for a Text of them."""
    return {
        "per_hour": money(answer, answer.per_hour), "minutes": answer.minutes,
        "needed": money(answer, answer.needed), "balance": money(answer, answer.balance),
    }  # fmt: skip


def cluster_request(owner, *, gpu_model, nodes, gpus_per_node, zone, rent: dict) -> ClusterRequest:
    """The saved request to rent as the cluster spec's, with the subscription's shape."""
    reference = (rent.get("image") or "").strip()
    image = image_by_reference(owner, reference) if reference else None
    return ClusterRequest(
        owner=owner,
        name=rent.get("name"),
        resource=f"gpu:{gpu_model.slug}",
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        image=image,
        custom_image=reference if image == CUSTOM else None,
        network=Cluster.Network.STANDARD,
        zone=zone,
        spot=bool(rent.get("spot")),
        volumes="",
        pub=True,
        ssh_keys=list(rent.get("ssh_keys") or ()),
        workspace=True,
        release_policy=Cluster.ReleasePolicy.NEVER,
    )


def subscribe(request: SubscriptionRequest, *, funds: FundsCheck) -> GpuSubscription:
    """Save the subscription, or ValidationError and nothing saved."""
    with transaction.atomic():
        return GpuSubscription.objects.create(**request.validate(funds=funds))


def cancel(sub: GpuSubscription) -> bool:
    """A waiting subscription cancelled; False when it had fired, expired or was cancelled."""
    return bool(
        GpuSubscription.objects.filter(pk=sub.pk, state=GpuSubscription.State.WAITING).update(
            state=GpuSubscription.State.CANCELLED
        )
    )


# -- the check --------------------------------------------------------------------------------


def _probe(sub: GpuSubscription) -> Cluster:
    """The subscription as a cluster placement plans (never saved)."""
    return Cluster(
        owner_id=sub.owner_id,
        gpu_model=sub.gpu_model,
        nodes=sub.nodes,
        gpus_per_node=sub.gpus_per_node,
        zone=sub.zone,
        network=Cluster.Network.STANDARD,
    )


def check(*, funds_of: Callable[[Any], FundsCheck], now=None) -> dict:
    """Expire what is past its time, and fire each waiting subscription that fits now:
    {"expired": n, "fired": [ids]}. Placement's plan on the free capacity decides, after
    the pending clusters' claim (they are in line before any newcomer). `funds_of(who)`:
    the balance check of a cluster rented by `who` (a user, or a team member's Actor)."""
    now = now or timezone.now()
    expired = GpuSubscription.objects.filter(
        state=GpuSubscription.State.WAITING, expires_at__lte=now
    ).update(state=GpuSubscription.State.EXPIRED)
    waiting = list(
        GpuSubscription.objects.filter(state=GpuSubscription.State.WAITING)
        .select_related("owner", "gpu_model")
        .order_by("created_at", "id")
    )
    fired: list[int] = []
    if not waiting:
        return {"expired": expired, "fired": fired}
    fleet = Fleet.load()
    for pending in fleet_reads.queue():
        if pending.stopped_at is None:
            fleet.reserve_for(pending)
    for sub in waiting:
        hosts = fleet.plan(_probe(sub))
        if hosts is None:
            continue
        try:
            cluster = fire(sub, funds_of=funds_of, now=now)
        except Exception:  # one subscription's trouble must not stop the others
            log.exception("GPU subscription %s: not fired", sub.pk)
            continue
        if cluster is False:
            continue
        fired.append(sub.pk)
        if cluster is not None:  # its GPUs are no longer anyone else's news
            for host_id in hosts:
                fleet.take(host_id, sub.gpus_per_node)
    return {"expired": expired, "fired": fired}


NOBODY_TOLD = gettext_noop(
    "None of your notification channels takes “GPUs you asked for are free”: nobody will be "
    "told when this subscription fires. Add a channel or tick the event on Notifications: "
    "%(url)s"
)


def heard(owner_id: int) -> bool:
    """Whether a subscription of the owner's firing now would reach anybody."""
    return bool(webhooks.listeners(owner_id, EVENT))


def unheard(sub: GpuSubscription) -> str:
    """For a waiting subscription whose owner has no channel that would carry its event
    (enabled, wanting `gpu.available`, an e-mail address confirmed): the warning, in the
    active language; else ""."""
    if sub.state != GpuSubscription.State.WAITING or heard(sub.owner_id):
        return ""
    return show(Text(NOBODY_TOLD, url=webhooks.console_link("webhooks")).as_json())


def where(sub: GpuSubscription) -> Text:
    return (
        Text(gettext_noop("in %(zone)s"), zone=sub.zone)
        if sub.zone
        else Text(gettext_noop("in any zone"))
    )


def fire(sub: GpuSubscription, *, funds_of: Callable[[Any], FundsCheck], now=None):
    """Fire once: False when another check fired (or cancelled) it first; else the cluster
    rented (None when notifying only, or when renting was refused). `funds_of(who)`: the
    balance check of a cluster rented by `who` (`renter`)."""
    now = now or timezone.now()
    with transaction.atomic():
        won = GpuSubscription.objects.filter(
            pk=sub.pk, state=GpuSubscription.State.WAITING, fired_at__isnull=True
        ).update(state=GpuSubscription.State.FIRED, fired_at=now)
        if not won:
            return False
        shape = shape_of(sub)
        data = {
            "subscription_id": sub.pk,
            "gpu_model": sub.gpu_model.slug,
            "nodes": sub.nodes,
            "gpus_per_node": sub.gpus_per_node,
            "zone": sub.zone,
        }
        cluster, outcome = None, None
        if sub.rent is None:
            data["url"] = webhooks.console_link("cluster_new")
            summary = Text(
                gettext_noop("%(shape)s are free %(where)s now: %(url)s"),
                shape=shape, where=where(sub), url=data["url"],
            )  # fmt: skip
        else:
            cluster, why = _rent(sub, funds_of)
            if cluster is not None:
                data["cluster_id"] = cluster.pk
                data["url"] = webhooks.console_link("cluster_detail", cluster.pk)
                outcome = Text(gettext_noop("your cluster %(name)s was created"), name=cluster.name)
                summary = Text(
                    gettext_noop(
                        "%(shape)s were free %(where)s: your cluster %(name)s was created "
                        "for you: %(url)s"
                    ),
                    shape=shape, where=where(sub), name=cluster.name, url=data["url"],
                )  # fmt: skip
            else:
                data["url"] = webhooks.console_link("cluster_new")
                data["refused"] = str(why)  # the English, as every event's data
                outcome = Text(gettext_noop("not rented: %(why)s"), why=why)
                summary = Text(
                    gettext_noop(
                        "%(shape)s are free %(where)s now, but renting them for you was "
                        "refused: %(why)s Rent them yourself: %(url)s"
                    ),
                    shape=shape, where=where(sub), why=why, url=data["url"],
                )  # fmt: skip
        told = webhooks.emit(owner_id=sub.owner_id, event_type=EVENT, data=data, summary=summary)
        if outcome is None:  # notify only: whether anybody was told is what happened
            outcome = Text(
                gettext_noop("told on your notification channels")
                if told is not None
                else gettext_noop(
                    "nobody was told: none of your notification channels takes this event"
                )
            )
        GpuSubscription.objects.filter(pk=sub.pk).update(cluster=cluster, outcome=outcome.as_json())
    return cluster


NO_LONGER_MEMBER = gettext_noop(
    "%(person)s, who made this subscription, may no longer rent for the team (no longer a "
    "member, or only a viewer)."
)


def renter(sub: GpuSubscription) -> Actor | None:
    """Who rents when `sub` fires: its owner, for a researcher's own; for a team's, the
    member who made it, acting for the team (its balance, their caps), read now and locked
    against their removal until the transaction ends; None when they are no longer a member
    (or never were: the principal itself), or only a viewer."""
    if not is_team_principal(sub.owner):
        return Actor.of(sub.owner)
    member = (
        TeamMember.objects.select_for_update(of=("self",))
        .select_related("team", "team__principal", "person")
        .filter(team__principal_id=sub.owner_id, person_id=sub.created_by_id)
        .first()
    )
    if member is None or not member.at_least(TeamMember.Role.MEMBER):
        return None
    return Actor.of_membership(member)


def _rent(sub: GpuSubscription, funds_of) -> tuple[Cluster | None, Text | str]:
    """The cluster, through the cluster spec and service as its renter (the balance, the
    member's caps and the budget checked now), or why not: a short balance, the budget and
    a maker no longer in the team as a Text (said in the reader's language), any other
    refusal of the spec (a member's caps too) in English."""
    who = renter(sub)
    if who is None:
        person = sub.created_by.get_username() if sub.created_by_id else "?"
        return None, Text(NO_LONGER_MEMBER, person=person)
    with translation.override("en"):
        return _rent_as(sub, who, funds_of(who))


def _rent_as(
    sub: GpuSubscription, who: Actor, funds: FundsCheck
) -> tuple[Cluster | None, Text | str]:
    prices = []

    def priced(**kwargs):
        answer = funds(**kwargs)
        if answer is not None:
            prices.append(answer)
        return answer

    request = cluster_request(
        sub.owner, gpu_model=sub.gpu_model, nodes=sub.nodes, gpus_per_node=sub.gpus_per_node,
        zone=sub.zone, rent=sub.rent,
    )  # fmt: skip
    checked = request.check(Offer.of(sub.owner), funds=priced)
    if checked.errors and prices and (capped := getattr(prices[0], "capped", "")):
        return None, capped  # the member's caps, with their figures
    if checked.errors and prices and prices[0].short:
        return None, Text(SHORT_BALANCE, **_amounts(prices[0]))
    if checked.errors:
        return None, " ".join(
            text for messages in checked.errors.values() for message in messages
            for text in ValidationError(message).messages
        )  # fmt: skip
    if sub.budget_per_hour is not None and prices and prices[0].per_hour > sub.budget_per_hour:
        return None, Text(
            OVER_BUDGET,
            per_hour=money(prices[0], prices[0].per_hour),
            budget=money(prices[0], sub.budget_per_hour),
        )
    try:
        with transaction.atomic():
            return services.cluster_create(
                owner=sub.owner, spec=checked.spec, created_by=who.person
            ), ""
    except ValidationError as exc:
        return None, " ".join(exc.messages)


def expires_in(sub: GpuSubscription, now=None) -> timedelta:
    return max(sub.expires_at - (now or timezone.now()), timedelta(0))
