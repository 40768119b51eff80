"""Researchers' forms. Validation says what to write instead; nothing is half-created."""

from dataclasses import dataclass, replace
from decimal import Decimal
from functools import partial

from django import forms
from django.conf import settings
from django.core.exceptions import NON_FIELD_ERRORS, ValidationError
from django.utils import timezone
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy

from billing import budgets, caps, formatting
from billing import selectors as money
from jobs.base import validators
from jobs.clusters import spec as cluster_spec
from jobs.clusters.services import ClusterSpec, JobSpec, ssh_keys_default
from jobs.clusters.spec import KeyChoices, max_nodes_message
from jobs.files import pub, storage
from jobs.models import Cluster, Image, InstanceType, Job, Pool, SshKey
from jobs.placement import fleet
from jobs.pools.autoscaler import PoolSpec
from jobs.tenancy.actors import Actor

CUSTOM_IMAGE = cluster_spec.CUSTOM
OWN_IMAGE = "own:"  # + the OwnImage's pk: one of the researcher's own images
ZONE_SPREAD_NOTE = gettext_lazy(
    "Spreading nodes over zones costs about 5 % more communication time."
)


class BudgetField(forms.CharField):
    """A budget, "stop at ¥X" (billing/budgets.py): optional; billing.budgets.parse's rules
    and words (more than 0, at most 2 decimals, at most 1,000,000). Cleaned: a Decimal, or
    None for no budget."""

    def __init__(self, **kwargs):
        kwargs.setdefault("required", False)
        kwargs.setdefault("max_length", 40)
        kwargs.setdefault("label", gettext_lazy("Budget: stop at (optional)"))
        kwargs.setdefault(
            "widget",
            forms.TextInput(
                attrs={"inputmode": "decimal", "placeholder": "50.00", "autocomplete": "off"}
            ),
        )
        super().__init__(**kwargs)

    def clean(self, value):
        return budgets.parse(super().clean(value))


BUDGET_HELP = {
    "job": gettext_lazy(
        "Stopped before its cost passes this (its cluster's price x the time it runs): its "
        "preemption script first, then SIGTERM and SIGKILL after the grace period; you are "
        "told early when its pace will reach it. Empty: no budget."
    ),
    "cluster": gettext_lazy(
        "Stopped, every file kept, before its charges pass this; you are told. Its kept files "
        "are still charged the stopped price (if the rate card has one) until you release it. "
        "Empty: no budget."
    ),
    "sweep": gettext_lazy(
        "Cancelled before its trials' cost passes this; no trial starts that would pass it. "
        "Empty: no budget."
    ),
}


class BudgetForm(forms.Form):
    """The small form on a job's, cluster's or sweep's page that sets or clears its budget."""

    budget = BudgetField(label=gettext_lazy("Stop at this much spent"))

    def __init__(self, *args, kind: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["budget"].help_text = BUDGET_HELP[kind]


@dataclass(frozen=True)
class Funds:
    """What a cluster of a shape costs and whether the balance covers the minutes a new
    (or grown) cluster must be able to pay for (`SUANLI_MIN_BALANCE_MINUTES`)."""

    per_hour: Decimal
    needed: Decimal
    balance: Decimal
    minutes: int
    currency: str
    # Why a team member's caps refuse it (billing.caps.cap_refusal), in words; "": they don't.
    capped: str = ""

    @property
    def short(self) -> bool:
        return self.balance < self.needed or bool(self.capped)

    def refusal(self, message: str, **extra) -> str:
        """`message` (translated) with the amounts, each with its currency ("¥15.6000"):
        %(per_hour)s, %(minutes)s, %(needed)s, %(balance)s and any `extra`; or the caps'
        refusal, which says its own figures."""
        if self.capped:
            return self.capped

        def money(value):
            return formatting.text(value, self.currency)

        return message % {
            "per_hour": money(self.per_hour), "minutes": self.minutes,
            "needed": money(self.needed), "balance": money(self.balance), **extra,
        }  # fmt: skip

    def as_context(self) -> dict:
        return {
            "needed": self.needed, "balance": self.balance, "minutes": self.minutes,
            "currency": self.currency, "per_hour": self.per_hour, "capped": self.capped,
        }  # fmt: skip


def check_funds(
    owner, *, gpu_model, instance_type, units: int, spot: bool, cluster: Cluster | None = None
) -> Funds | None:
    """The balance check of creating a cluster (and of growing one); None when the shape
    has no price on the rate card. `owner`: a researcher, or an Actor (a team's member:
    the team's balance, and the person's caps in it). `cluster`: the one being started or
    grown (its maker's caps; its new size is the ask)."""
    quote = money.quote_for(
        gpu_model_id=gpu_model.pk if gpu_model else None,
        instance_type_id=instance_type.pk if instance_type else None,
        units=units,
    )
    actor = Actor.of(owner)
    principal, person = actor.principal, actor.person
    if cluster is not None:
        principal, person = cluster.owner, cluster.created_by
    per_hour = (quote.spot if spot else quote.on_demand) if quote.priced else Decimal(0)
    capped = caps.cap_refusal(
        principal=principal, person=person, per_hour=per_hour,
        gpus=units if gpu_model else 0, besides=cluster.pk if cluster else None,
        by=actor.person if actor.for_a_team else None,
    )  # fmt: skip
    if not quote.priced and not capped:
        return None  # no price: no balance to check (a GPU cap holds all the same)
    minutes = settings.SUANLI_MIN_BALANCE_MINUTES
    return Funds(
        per_hour=per_hour,
        needed=(per_hour * minutes / 60).quantize(per_hour) if quote.priced else per_hour,
        balance=money.balance_of(principal),
        minutes=minutes,
        currency=quote.currency,
        capped=capped,
    )


def start_refusal(cluster, mode: str, *, actor=None) -> str:
    """Why the owner's balance cannot start a stopped cluster in this mode ("" when it
    can): the same minutes of balance as creating one of its shape (no-GPU mode: at its
    price per node-hour). `actor`: who presses Start (a teammate starting a cluster
    another made is told whose budget refuses it)."""
    if why := budgets.start_refusal(cluster):
        return why
    by = actor.person if actor is not None and actor.for_a_team else None
    if mode == "no_gpu":
        prices = money.stop_prices()
        if prices.no_gpu is None:
            return ""
        per_hour = prices.no_gpu * cluster.nodes
        minutes = settings.SUANLI_MIN_BALANCE_MINUTES
        funds = Funds(
            per_hour=per_hour, needed=(per_hour * minutes / 60).quantize(per_hour),
            balance=money.balance_of(cluster.owner), minutes=minutes, currency=prices.currency,
            capped=caps.cap_refusal(
                principal=cluster.owner, person=cluster.created_by, per_hour=per_hour, by=by
            ),
        )  # fmt: skip
        message = _(
            "Without GPUs this cluster costs %(per_hour)s/h; starting it needs a "
            "balance for %(minutes)s minutes (%(needed)s). Your balance is "
            "%(balance)s: top up on the billing page."
        )
    else:
        units = cluster.nodes * (cluster.gpus_per_node if cluster.gpu_model_id else 1)
        funds = check_funds(
            actor if by is not None else cluster.owner, gpu_model=cluster.gpu_model,
            instance_type=None if cluster.gpu_model_id else cluster.instance_type,
            units=units, spot=cluster.spot, cluster=cluster,
        )  # fmt: skip
        message = _(
            "This cluster costs %(per_hour)s/h; starting it needs a balance for "
            "%(minutes)s minutes (%(needed)s). Your balance is %(balance)s: "
            "top up on the billing page."
        )
    if funds is None or not funds.short:
        return ""
    return funds.refusal(message)


class ShutdownFields(forms.Form):
    """Scheduled and idle shutdown (定时关机): the spec's three fields (their shapes and
    words: jobs/clusters/spec.py shutdown_fields) as the page shows them. A time is in the
    reader's zone (their preferences')."""

    _shapes = cluster_spec.shutdown_fields()
    stop_at = _shapes["stop_at"]
    stop_at.label = gettext_lazy("Stop at")
    stop_at.widget = forms.DateTimeInput(attrs={"type": "datetime-local"}, format="%Y-%m-%dT%H:%M")
    stop_at.widget.is_required = False
    stop_idle_minutes = _shapes["stop_idle_minutes"]
    stop_idle_minutes.label = gettext_lazy("Stop when idle for (minutes)")
    stop_idle_minutes.widget.attrs.update(placeholder="30", min=10, max=1440)
    stop_idle_below = _shapes["stop_idle_below"]
    stop_idle_below.label = gettext_lazy("With every GPU under (%)")
    stop_idle_below.widget.attrs.update(placeholder="5", min=1, max=100)
    stop_idle_below.help_text = gettext_lazy(
        "Judged by the monitor's samples of every GPU; without samples (the monitor down) "
        "it never stops. Its files are kept either way."
    )
    del _shapes

    def _zone_note(self) -> None:
        now = timezone.localtime()
        offset = now.strftime("%z")
        zone = f"{now.tzname()}, UTC{offset[:3]}:{offset[3:]}"
        self.fields["stop_at"].help_text = _(
            "Once, at this time (%(zone)s): the cluster stops, its files kept."
        ) % {"zone": zone}


class ClusterForm(ShutdownFields):
    """A new cluster on the page: its fields parse what the browser sent (and offer the
    choices); the rules are the cluster spec's (jobs/clusters/spec.py), whose refusals
    land on the fields of the same names."""

    unique_name = True  # a pool's clusters take the pool's name: PoolForm checks its own

    name = forms.CharField(
        max_length=cluster_spec.NAME_MAX,
        label=gettext_lazy("Name"),
        help_text=gettext_lazy("Lower-case letters, digits and dashes, e.g. llama-ft-1."),
    )
    resource = forms.ChoiceField(label=gettext_lazy("GPU model or CPU-only type"))
    nodes = forms.IntegerField(min_value=1, initial=1, label=gettext_lazy("Nodes"))
    gpus_per_node = forms.IntegerField(
        label=gettext_lazy("GPUs per node"), min_value=1, initial=1, required=False
    )
    image = forms.ChoiceField(label=gettext_lazy("Image"))
    custom_image = forms.CharField(
        label=gettext_lazy("Custom image reference"), required=False,
        max_length=cluster_spec.CUSTOM_IMAGE_MAX,
        help_text=gettext_lazy("Only with 'Custom image', e.g. nvcr.io/nvidia/pytorch:24.05-py3."),
    )  # fmt: skip
    network = forms.ChoiceField(
        label=gettext_lazy("Network"),
        choices=Cluster.Network.choices,
        initial=Cluster.Network.STANDARD,
        widget=forms.RadioSelect,
    )
    zone = forms.ChoiceField(required=False, label=gettext_lazy("Zone"), help_text=ZONE_SPREAD_NOTE)
    spot = forms.BooleanField(
        required=False,
        label=gettext_lazy("Spot (cheaper; the operator may take it back with notice)"),
    )
    volumes = forms.CharField(
        required=False,
        label=gettext_lazy("Volumes"),
        widget=forms.Textarea(attrs={"rows": 3, "spellcheck": "false"}),
        initial="workspace:/workspace",
        help_text=gettext_lazy(
            "One per line: storage-folder:/container/path[:ro], e.g. datasets:/workspace/data:ro. "
            "A storage folder is one name (letters, digits, '.', '_', '-'), created when missing; "
            "a volume mounts the whole folder, so for a sub-folder mount its folder and use the "
            "path inside the container (/workspace/data/imagenet)."
        ),
    )
    # On by default, as AutoDL's 公开数据 is always there: a read-only folder costs a cluster
    # nothing, and an image that wants /pub for itself unticks it.
    pub = forms.BooleanField(
        required=False,
        initial=True,
        label=gettext_lazy("Public datasets and models, read-only at /pub"),
    )
    ssh_keys = KeyChoices(
        queryset=SshKey.objects.none(),
        required=False,
        widget=forms.CheckboxSelectMultiple,
        label=gettext_lazy("SSH keys"),
    )
    workspace = forms.BooleanField(
        required=False,
        initial=True,
        label=gettext_lazy(
            "Workspace on each node: log in with ssh, scp/sftp and the web terminal"
        ),
        help_text=gettext_lazy(
            "A container on every node from placement to release, beside your jobs. "
            "Untick for pure batch use (jobs only)."
        ),
    )
    # Kept by default (AutoDL's instance: it stays until its owner stops or releases it);
    # a release on its own is the researcher's choice, and says what goes with it.
    release_policy = forms.ChoiceField(
        label=gettext_lazy("Release policy"),
        choices=[
            (
                Cluster.ReleasePolicy.NEVER,
                gettext_lazy(
                    "Keep it until I stop or release it: the workspace and its files stay"
                ),
            ),
            (
                Cluster.ReleasePolicy.AFTER_LAST_JOB,
                gettext_lazy(
                    "Release it when its last job ends: the workspace goes, with every file "
                    "outside your volumes"
                ),
            ),
            (
                Cluster.ReleasePolicy.IDLE,
                gettext_lazy(
                    "Release it after N idle minutes: the workspace goes, with every file "
                    "outside your volumes"
                ),
            ),
        ],
        initial=Cluster.ReleasePolicy.NEVER,
        widget=forms.RadioSelect,
    )
    idle_minutes = forms.IntegerField(
        min_value=1,
        max_value=cluster_spec.IDLE_MINUTES_MAX,
        required=False,
        label=gettext_lazy("Idle minutes"),
    )
    budget = BudgetField(help_text=BUDGET_HELP["cluster"])

    def __init__(self, *args, owner, **kwargs):
        super().__init__(*args, **kwargs)
        # `owner`: a researcher, or an Actor. The cluster is its principal's (images, names,
        # balance); the SSH keys offered are always the person's own.
        self.actor = Actor.of(owner)
        self.owner = owner = self.actor.principal
        self.funds_short = None
        self.checked: cluster_spec.Checked | None = None
        self.offer = cluster_spec.Offer.of(owner, person=self.actor.person)
        self.capacity = self.offer.capacity
        self.rooms = self.offer.rooms  # every registered host: what could ever fit
        self.gpu_models = self.offer.gpu_models
        self.instance_types = self.offer.instance_types
        self._resource_choices()
        self._image_choices()
        self._place_choices()
        person = self.actor.person
        self.fields["ssh_keys"].queryset = SshKey.objects.filter(owner=person)
        # The person's default keys come ticked on a new form (SshKey.is_default).
        self.fields["ssh_keys"].initial = [k.pk for k in ssh_keys_default(person)]
        self._pub_note()
        self._zone_note()

    def _resource_choices(self) -> None:
        """The GPU models, each with what is free where (or why none can be placed), and
        the CPU-only types; preselected: a model that can be had now."""
        registered = {r.gpu_model_id for r in self.rooms if r.gpus}
        choices = []
        for slug, model in self.gpu_models.items():
            cap = self.capacity.get(model.pk)
            if cap:
                per_zone = ", ".join(f"{z} {n}" for z, n in sorted(cap["zones"].items()))
                values = {
                    "model": model.name, "free": sum(cap["zones"].values()), "zones": per_zone,
                }  # fmt: skip
                if cap.get("cpus_per_gpu") and cap.get("memory_gb_per_gpu"):
                    values.update(
                        cpus=f"{cap['cpus_per_gpu']:g}", memory=f"{cap['memory_gb_per_gpu']:.0f}"
                    )
                    label = (
                        _(
                            "%(model)s — %(free)s free (%(zones)s); per GPU %(cpus)s vCPU, "
                            "%(memory)s GB memory"
                        )
                        % values
                    )
                else:
                    label = _("%(model)s — %(free)s free (%(zones)s)") % values
            elif model.pk in registered:
                label = _("%(model)s — cannot be placed now: its hosts are down or draining") % {
                    "model": model.name
                }
            else:
                label = _("%(model)s — no host now") % {"model": model.name}
            choices.append((f"gpu:{slug}", label))
        available = [
            f"gpu:{slug}" for slug, m in self.gpu_models.items() if self.capacity.get(m.pk)
        ]
        if available and not self.is_bound:
            self.initial.setdefault("resource", available[0])
        cpu = [(f"cpu:{name}", self._cpu_label(t)) for name, t in self.instance_types.items()]
        self.fields["resource"].choices = [
            (_("GPUs"), choices),
            (_("CPU-only (for debugging)"), cpu),
        ]
        self.fields["resource"].help_text = self._system_disk_note()

    def _image_choices(self) -> None:
        """The catalog's images, each with where it can run now (catalog.availability:
        on hosts, pulled on first use, being prepared, not available), then the owner's
        own; preselected: the first that can run."""
        self.images = self.offer.images
        self.own_images = {f"{OWN_IMAGE}{i.pk}": i for i in self.offer.own_images}
        where = self.offer.availability
        choices = [
            (pk, f"{i.name} ({i.reference}) — {where[i.pk]}") for pk, i in self.images.items()
        ]
        runnable = [pk for pk, i in self.images.items() if where[i.pk].runnable]
        if runnable and not self.is_bound:
            self.initial.setdefault("image", runnable[0])
        self.image_availability = [(i, where[i.pk]) for i in self.images.values()]
        if self.own_images:
            choices.append(
                (
                    _("Your images"),
                    [(key, f"{i.name}:{i.tag}") for key, i in self.own_images.items()],
                )
            )
        self.fields["image"].choices = [*choices, (CUSTOM_IMAGE, _("Custom image…"))]

    def _place_choices(self) -> None:
        """Zones, networks and the most nodes, as the fleet offers them now."""
        self.zones = self.offer.zones
        self.fields["zone"].choices = [("", _("Any zone"))] + [(z, z) for z in self.zones]
        self.rdma = self.offer.rdma
        if not self.rdma:
            self.fields["network"].choices = [
                (Cluster.Network.STANDARD, Cluster.Network.STANDARD.label)
            ]
            self.fields["network"].help_text = _(
                "High-performance (RDMA) networking is offered where RDMA hosts exist; none does now."
            )
        else:
            self.fields["network"].help_text = _("RDMA clusters stay within one zone.")
        self.fields["nodes"].max_value = settings.SUANLI_MAX_NODES
        self.fields["nodes"].widget.attrs["max"] = settings.SUANLI_MAX_NODES

    def _pub_note(self) -> None:
        names = list(pub.published().values_list("name", flat=True)[:11])
        if names:
            shown = ", ".join(names[:10]) + (", …" if len(names) > 10 else "")
            self.fields["pub"].help_text = _(
                "What the operator publishes, the same on every node: %(names)s."
            ) % {"names": shown}
        else:
            self.fields["pub"].help_text = _("Nothing is published yet; /pub is empty until then.")

    def _system_disk_note(self) -> str:
        """Each node's system disk (its root filesystem, jobs.models.root_disk_gb): the
        default, and the GPU models and CPU types the operator gave another."""
        default = settings.SUANLI_ROOT_DISK_GB
        own = [
            f"{kind.name} {kind.root_disk_gb} GB"
            for kind in [*self.gpu_models.values(), *self.instance_types.values()]
            if kind.root_disk_gb and kind.root_disk_gb != default
        ]
        note = _("System disk: %(gb)s GB (files outside your volumes)") % {"gb": default}
        if own:
            note += _("; except %(kinds)s") % {"kinds": ", ".join(own)}
        return note

    def _cpu_label(self, itype: InstanceType) -> str:
        """A CPU type's label (its name, vCPUs and memory), with what keeps it from being
        placed now."""
        if any(r.active and r.free_cpus >= itype.vcpus for r in self.rooms):
            return _("CPU only: %(type)s") % {"type": itype}
        largest = max((r.cpus for r in self.rooms), default=0)
        if largest < itype.vcpus:
            return _(
                "CPU only: %(type)s — cannot be placed: the largest host has %(largest)s vCPUs"
            ) % {"type": itype, "largest": largest}
        return _("CPU only: %(type)s — cannot be placed now: no host has the vCPUs free") % {
            "type": itype
        }

    def clean(self):
        """The cluster spec's rules on the parsed fields; its refusals on the fields they
        name (the balance above the form)."""
        data = super().clean()
        self.checked = self._request(data).check(self.offer, funds=partial(check_funds, self.actor))
        for name, errors in self.checked.errors.items():
            field = None if name == NON_FIELD_ERRORS or name not in self.fields else name
            self.add_error(field, errors)
        self.funds_short = self.checked.funds_short or self.funds_short
        c = self.checked
        if "volumes" in data:  # parsed by the spec
            data["volumes"] = c.volumes or []
        data.update(
            gpu_model=c.gpu_model, instance_type=c.instance_type, image_obj=c.image,
            reference=c.reference, own_image=c.own_image,
        )  # fmt: skip
        return data

    def _request(self, data: dict) -> cluster_spec.ClusterRequest:
        """The parsed fields as the spec's request: those the fields refused are left out
        (a PoolForm's clusters have no ssh_keys, workspace or release_policy fields)."""
        choice = data.get("image")
        if choice == CUSTOM_IMAGE:
            image = cluster_spec.CUSTOM
        elif (choice or "").startswith(OWN_IMAGE):
            image = self.own_images.get(choice)
        else:
            image = self.images.get(choice) if choice else None
        given = {**data, "image": image}
        names = cluster_spec.ClusterRequest.FIELDS
        return cluster_spec.ClusterRequest(
            owner=self.owner,
            parsed=True,
            refused=frozenset(name for name in names if name in self.errors),
            unique_name=self.unique_name,
            **{name: given[name] for name in names if name in data},
        )

    def spec(self) -> ClusterSpec:
        return replace(self.checked.spec, budget=self.cleaned_data.get("budget"))


class PoolForm(ClusterForm):
    """A pool (issue 26): the cluster form's shape, image, network, zone and volumes for
    every cluster of the pool, and how many clusters, how long idle, and what it may
    spend. Its clusters have no workspace, no SSH keys and no release policy of their own:
    the pool adds and releases them."""

    MOST_CLUSTERS = 100
    unique_name = False  # its own rule (clean_name): no active pool of the owner's with it
    budget = None  # its own budgets (per hour, total); its clusters have none of their own

    min_clusters = forms.IntegerField(
        label=gettext_lazy("Minimum clusters"), min_value=0, max_value=MOST_CLUSTERS, initial=0,
        help_text=gettext_lazy("Kept even when idle; 0 releases every idle cluster."),
    )  # fmt: skip
    max_clusters = forms.IntegerField(
        label=gettext_lazy("Maximum clusters"), min_value=1, max_value=MOST_CLUSTERS, initial=2,
        help_text=gettext_lazy("Added one by one while jobs wait, up to this many."),
        error_messages={"min_value": gettext_lazy("Give 1 or more: a pool of 0 clusters runs nothing.")},
    )  # fmt: skip
    idle_minutes = forms.IntegerField(
        label=gettext_lazy("Idle minutes"), min_value=1, max_value=7 * 24 * 60, initial=10,
        help_text=gettext_lazy("A cluster idle this long is released (down to the minimum)."),
    )  # fmt: skip
    budget_per_hour = forms.DecimalField(
        label=gettext_lazy("Budget per hour (optional)"), required=False, max_digits=16,
        decimal_places=4,
        help_text=gettext_lazy("No more clusters at once than this pays for an hour."),
    )  # fmt: skip
    budget_total = forms.DecimalField(
        label=gettext_lazy("Total budget (optional)"), required=False, max_digits=16,
        decimal_places=4,
        help_text=gettext_lazy("Once the pool has spent this, it adds no cluster and releases idle ones."),
    )  # fmt: skip

    def __init__(self, *args, owner, **kwargs):
        super().__init__(*args, owner=owner, **kwargs)
        for name in ("ssh_keys", "workspace", "release_policy", *cluster_spec.SHUTDOWN_FIELDS):
            del self.fields[name]
        self.rate_per_hour = None  # one cluster's price per hour, once clean

    def clean_name(self):
        name = self.cleaned_data["name"]
        try:
            validators.validate_host_name(name)
        except ValidationError:
            raise ValidationError(
                _("Use lower-case letters, digits and dashes, e.g. llama-ft-1.")
            ) from None
        if Pool.objects.filter(owner=self.owner, name=name, state=Pool.State.ACTIVE).exists():
            raise ValidationError(_("You have an active pool with this name already."))
        return name

    @staticmethod
    def _positive(value):
        if value is not None and value <= 0:
            raise ValidationError(_("A budget is more than 0; leave it empty for none."))
        return value

    def clean_budget_per_hour(self):
        return self._positive(self.cleaned_data.get("budget_per_hour"))

    def clean_budget_total(self):
        return self._positive(self.cleaned_data.get("budget_total"))

    def clean(self):
        data = super().clean()
        # What every cluster of a pool is, whatever the cluster form would ask.
        data.update(ssh_keys=[], workspace=False, release_policy=Cluster.ReleasePolicy.NEVER)
        low, high = data.get("min_clusters"), data.get("max_clusters")
        if low is not None and high is not None and low > high:
            self.add_error(
                "min_clusters",
                _("The minimum (%(min)s) is more than the maximum (%(max)s).")
                % {"min": low, "max": high},
            )
        gpu_model, instance_type = data.get("gpu_model"), data.get("instance_type")
        units = (data.get("nodes") or 0) * ((data.get("gpus_per_node") or 0) if gpu_model else 1)
        if (gpu_model or instance_type) and units:
            quote = money.quote_for(
                gpu_model_id=gpu_model.pk if gpu_model else None,
                instance_type_id=instance_type.pk if instance_type else None,
                units=units,
            )
            if quote.priced:
                self.rate_per_hour = quote.spot if data.get("spot") else quote.on_demand
                self._check_budget(data, quote.currency)
            self._check_minimum_funds(data, gpu_model, instance_type, units)
        return data

    def _check_minimum_funds(self, data, gpu_model, instance_type, units: int) -> None:
        """The pool starts its minimum at once: the balance covers them all, as it would
        that many clusters made one by one (the cluster form checked one)."""
        low = data.get("min_clusters") or 0
        if low < 2 or self.errors:
            return
        funds = check_funds(
            self.actor, gpu_model=gpu_model, instance_type=instance_type, units=units * low,
            spot=bool(data.get("spot")),
        )  # fmt: skip
        if funds is not None and funds.short:
            self.funds_short = funds.as_context()
            message = _(
                "The pool's minimum of %(min)s clusters costs %(per_hour)s/h; creating it "
                "needs a balance for %(minutes)s minutes (%(needed)s). Your balance is "
                "%(balance)s: top up on the billing page."
            )
            self.add_error("min_clusters", funds.refusal(message, min=low))

    def _check_budget(self, data, currency: str) -> None:
        budget, rate = data.get("budget_per_hour"), self.rate_per_hour
        if budget is None or not rate:
            return
        values = {
            "budget": formatting.total_text(budget, currency),
            "rate": formatting.text(formatting.amount(rate), currency),
        }
        if budget < rate:
            self.add_error(
                "budget_per_hour",
                _(
                    "A budget of %(budget)s per hour does not pay for one cluster (%(rate)s per hour)."
                )
                % values,
            )
        elif data.get("min_clusters") and budget < rate * data["min_clusters"]:
            self.add_error(
                "budget_per_hour",
                _(
                    "A budget of %(budget)s per hour does not pay for the minimum of %(min)s "
                    "clusters (%(rate)s per hour each)."
                )
                % {**values, "min": data["min_clusters"]},
            )

    def spec(self) -> PoolSpec:
        d = self.cleaned_data
        return PoolSpec(
            name=d["name"],
            cluster=replace(
                super().spec(),
                idle_minutes=None,
                ssh_keys=(),
                workspace=False,
                release_policy=Cluster.ReleasePolicy.NEVER,
            ),  # fmt: skip
            min_clusters=d["min_clusters"],
            max_clusters=d["max_clusters"],
            idle_minutes=d["idle_minutes"],
            budget_per_hour=d.get("budget_per_hour"),
            budget_total=d.get("budget_total"),
        )


class ShutdownForm(ShutdownFields):
    """A cluster's shutdown rules on its page, whole (an empty field: no such rule),
    checked by the spec's ShutdownRequest; `schedule` once valid."""

    def __init__(self, *args, cluster: Cluster, **kwargs):
        kwargs.setdefault("initial", {n: getattr(cluster, n) for n in cluster_spec.SHUTDOWN_FIELDS})
        super().__init__(*args, **kwargs)
        self.cluster = cluster
        self.schedule: cluster_spec.Schedule | None = None
        self._zone_note()

    def clean(self):
        data = super().clean()
        names = cluster_spec.SHUTDOWN_FIELDS
        self.schedule, errors = cluster_spec.ShutdownRequest(
            cluster=self.cluster,
            parsed=True,
            refused=frozenset(n for n in names if n in self.errors),
            **{n: data.get(n) for n in names if n not in self.errors},
        ).errors()
        for name, said in errors.items():
            self.add_error(None if name == NON_FIELD_ERRORS else name, said)
        return data


class ResizeForm(forms.Form):
    """More nodes pass the same balance check as creating the cluster at its new size (a
    researcher refused a 2-node cluster cannot get one by resizing a 1-node one); fewer
    nodes always pass."""

    nodes = forms.IntegerField(min_value=1, label=gettext_lazy("Nodes"))

    def __init__(self, *args, cluster: Cluster, **kwargs):
        super().__init__(*args, **kwargs)
        self.cluster = cluster

    def clean_nodes(self):
        nodes = self.cleaned_data["nodes"]
        if nodes > settings.SUANLI_MAX_NODES:
            raise ValidationError(max_nodes_message())
        cluster = self.cluster
        if nodes > cluster.nodes:
            # A size no set of registered hosts could hold is refused, not tried.
            fit = fleet.largest_fit(
                gpu_model=cluster.gpu_model,
                instance_type=None if cluster.gpu_model_id else cluster.instance_type,
                network=cluster.network,
                zone=cluster.zone,
            )
            per_node = cluster.gpus_per_node if cluster.gpu_model_id else 0
            why = fit.refusal(nodes=nodes, per_node=per_node)
            if why:
                raise ValidationError(why)
            units = nodes * (cluster.gpus_per_node if cluster.gpu_model_id else 1)
            funds = check_funds(
                cluster.owner,
                gpu_model=cluster.gpu_model,
                instance_type=cluster.instance_type,
                units=units,
                spot=cluster.spot,
                cluster=cluster,
            )
            if funds is None:
                raise ValidationError(
                    _(
                        "%(resource)s has no price on the rate card now, so the cluster cannot "
                        "grow; ask an operator."
                    )
                    % {"resource": cluster.resource_label}
                )
            if funds.short:
                message = _(
                    "With %(nodes)s nodes this cluster costs %(per_hour)s/h; growing "
                    "it needs a balance for %(minutes)s minutes (%(needed)s). Your "
                    "balance is %(balance)s: top up on the billing page."
                )
                raise ValidationError(funds.refusal(message, nodes=nodes))
        return nodes


class SshKeyForm(forms.Form):
    name = forms.CharField(
        max_length=80,
        required=False,
        label=gettext_lazy("Name"),
        help_text=gettext_lazy("Defaults to the key's comment."),
    )
    public_key = forms.CharField(
        label=gettext_lazy("Public key"),
        widget=forms.Textarea(
            attrs={
                "rows": 3,
                "spellcheck": "false",
                "placeholder": "ssh-ed25519 AAAA... you@laptop",
            }
        ),
        max_length=16384,
        help_text=gettext_lazy(
            "The contents of your .pub file: ed25519, ecdsa, or rsa with at least 2048 bits."
        ),
    )
    is_default = forms.BooleanField(
        required=False,
        label=gettext_lazy("Default for new clusters (ticked on the new-cluster form)"),
    )

    def clean_public_key(self):
        value = self.cleaned_data["public_key"]
        self.parsed = validators.parse_ssh_public_key(value)
        return value


class JobForm(forms.Form):
    name = forms.CharField(max_length=100, initial="train", label=gettext_lazy("Name"))
    command = forms.CharField(
        label=gettext_lazy("Command"),
        widget=forms.Textarea(attrs={"rows": 4, "spellcheck": "false"}),
        help_text=gettext_lazy(
            "Run by the container's shell on every node. With torchrun: the script and its "
            "arguments, e.g. train.py --epochs 3."
        ),
    )
    launcher = forms.ChoiceField(
        label=gettext_lazy("Launcher"),
        choices=Job.Launcher.choices,
        initial=Job.Launcher.PLAIN,
        widget=forms.RadioSelect,
    )
    env = forms.CharField(
        label=gettext_lazy("Environment"),
        required=False,
        widget=forms.Textarea(
            attrs={"rows": 3, "spellcheck": "false", "placeholder": "LR=3e-4\nWANDB_MODE=offline"}
        ),
        help_text=gettext_lazy("KEY=VALUE, one per line."),
    )
    workdir = forms.CharField(
        label=gettext_lazy("Working directory"), initial="/workspace", max_length=255
    )
    checkpoint_dir = forms.CharField(
        label=gettext_lazy("Checkpoint directory"), initial="/workspace/checkpoints", max_length=255
    )
    max_runtime_min = forms.IntegerField(
        label=gettext_lazy("Maximum runtime (minutes)"),
        required=False,
        min_value=1,
        max_value=60 * 24 * 30,
    )
    retries = forms.IntegerField(
        initial=0,
        min_value=0,
        max_value=10,
        label=gettext_lazy("Retries"),
        help_text=gettext_lazy("Restarts after a failure."),
    )
    preemption_script = forms.CharField(
        label=gettext_lazy("Preemption script"),
        required=False,
        widget=forms.Textarea(
            attrs={
                "rows": 3,
                "spellcheck": "false",
                "placeholder": "touch $SUANLI_CHECKPOINT_DIR/.save-now; sleep 30",
            }
        ),
    )
    max_preemptions = forms.IntegerField(
        label=gettext_lazy("Maximum preemptions"),
        required=False,
        initial=5,
        min_value=0,
        max_value=100,
        help_text=gettext_lazy(
            "Spot clusters only: preemptions the job survives (it restarts when the "
            "cluster is placed again); one more fails it. Not counted against retries."
        ),
    )
    budget = BudgetField(help_text=BUDGET_HELP["job"])

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # The limits are settings: read them per form, not once at import.
        self.fields["preemption_script"].help_text = _(
            "Spot clusters only: run in each replica with /bin/sh -c when a preemption notice "
            "arrives, e.g. to save a checkpoint. It has %(script_s)s s; then the replicas get "
            "SIGTERM, and SIGKILL %(grace_s)s s later."
        ) % {
            "script_s": settings.SUANLI_PREEMPT_SCRIPT_S,
            "grace_s": settings.SUANLI_PREEMPT_GRACE_S,
        }

    @staticmethod
    def _shell_text(value: str, too_long: str, nul: str) -> str:
        """Text run by /bin/sh: a browser's CRLF line ends would reach the shell as part of
        each command, so they are made plain newlines; NUL cannot be passed at all.
        `too_long` says so with %(length)s and %(limit)s; `nul` refuses a NUL."""
        text = value.replace("\r\n", "\n").strip()
        limit = settings.SUANLI_JOB_COMMAND_MAX
        if len(text) > limit:
            raise ValidationError(too_long % {"length": f"{len(text):,}", "limit": f"{limit:,}"})
        if "\x00" in text:
            raise ValidationError(nul)
        return text

    def clean_command(self):
        return self._shell_text(
            self.cleaned_data["command"],
            _(
                "The command is %(length)s characters; at most %(limit)s. Put long scripts in a "
                "file on a volume."
            ),
            _("The command may not contain NUL characters."),
        )

    def clean_preemption_script(self):
        return self._shell_text(
            self.cleaned_data.get("preemption_script") or "",
            _(
                "The preemption script is %(length)s characters; at most %(limit)s. Put long "
                "scripts in a file on a volume."
            ),
            _("The preemption script may not contain NUL characters."),
        )

    def clean_max_preemptions(self):
        value = self.cleaned_data.get("max_preemptions")
        return 5 if value is None else value

    def clean_env(self):
        return validators.parse_env(self.cleaned_data.get("env", ""))

    def clean_workdir(self):
        return storage.validate_target(self.cleaned_data["workdir"], allow_system=True)

    def clean_checkpoint_dir(self):
        return storage.validate_target(self.cleaned_data["checkpoint_dir"])

    def spec(self) -> JobSpec:
        d = self.cleaned_data
        return JobSpec(
            name=d["name"],
            command=d["command"],
            launcher=d["launcher"],
            env=d["env"],
            workdir=d["workdir"],
            checkpoint_dir=d["checkpoint_dir"],
            max_runtime_s=d["max_runtime_min"] * 60 if d.get("max_runtime_min") else None,
            retries=d.get("retries") or 0,
            preemption_script=d.get("preemption_script") or "",
            max_preemptions=d["max_preemptions"],
            budget=d.get("budget"),
        )


# -- own images -------------------------------------------------------------------------------


def example_dockerfile() -> str:
    """The build form's starting text: the seed's style, FROM the catalog's first image."""
    first = Image.objects.filter(active=True).first()
    return (
        f"FROM {first.reference if first else '<a catalog image>'}\n"
        "# e.g. RUN pip install --no-cache-dir transformers==4.44.0\n"
        'RUN mkdir -p /opt/project && echo "built with Suanli" > /opt/project/NOTE\n'
        "ENV PROJECT_HOME=/opt/project\n"
        "WORKDIR /workspace\n"
    )


def parse_build_args(text: str) -> dict[str, str]:
    """KEY=VALUE lines (blank lines and # comments skipped): the Dockerfile's ARG values."""
    return validators.parse_assignments(
        text, what="argument", example="TORCH_VERSION=2.4.0", most=50
    )


def attach_errors(form: forms.Form, exc: ValidationError) -> None:
    """A service's refusal on the form: per field where it names one of the form's, else
    above the form."""
    if not hasattr(exc, "error_dict"):
        form.add_error(None, exc.messages)
        return
    for name, errors in exc.message_dict.items():
        form.add_error(name if name in form.fields else None, errors)


class _ImageNameForm(forms.Form):
    name = forms.CharField(
        max_length=64,
        label=gettext_lazy("Name"),
        help_text=gettext_lazy(
            "Lower-case letters and digits, with dots, dashes or underscores between "
            "them, e.g. my-pytorch."
        ),
    )
    tag = forms.CharField(
        max_length=64,
        initial="latest",
        label=gettext_lazy("Tag"),
        help_text=gettext_lazy("e.g. latest, v1, 2024-06-01."),
    )

    def clean_name(self):
        name = self.cleaned_data["name"].strip()
        validators.validate_own_image_name(name)
        return name

    def clean_tag(self):
        tag = self.cleaned_data["tag"].strip()
        validators.validate_own_image_tag(tag)
        return tag


class ImageBuildForm(_ImageNameForm):
    dockerfile = forms.CharField(
        label="Dockerfile",
        strip=False,
        widget=forms.Textarea(attrs={"rows": 10, "spellcheck": "false"}),
        help_text=gettext_lazy(
            "FROM a catalog image, one of your own images, or an image the operator "
            "allows; no FROM of anything else."
        ),
    )
    context = forms.CharField(
        label=gettext_lazy("Build context (optional)"),
        required=False,
        max_length=255,
        help_text=gettext_lazy(
            "One of your storage folders, by its name (as a cluster's volume names it, "
            "e.g. my-project), sent as the build's context so that COPY and ADD see its files. "
            "Empty: the Dockerfile alone."
        ),
    )
    build_args = forms.CharField(
        label=gettext_lazy("Build arguments"),
        required=False,
        widget=forms.Textarea(
            attrs={"rows": 3, "spellcheck": "false", "placeholder": "TORCH_VERSION=2.4.0"}
        ),
        help_text=gettext_lazy("KEY=VALUE, one per line: values for the Dockerfile's ARG lines."),
    )

    def clean_dockerfile(self):
        text = self.cleaned_data["dockerfile"].replace("\r\n", "\n")
        if not text.strip():
            raise ValidationError(_("Write the Dockerfile, starting with a FROM line."))
        return text

    def clean_context(self):
        return (self.cleaned_data.get("context") or "").strip()

    def clean_build_args(self):
        return parse_build_args(self.cleaned_data.get("build_args") or "")


class SaveImageForm(_ImageNameForm):
    """A node's workspace saved as one of the researcher's images."""
