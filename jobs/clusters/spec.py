"""What a cluster may be, checked in one place: a `ClusterRequest` (the fields as a
researcher gave them, from the console's form or the API's JSON) is checked against what
the fleet and catalog offer its owner now (`Offer`) into a `ClusterSpec` (what
`services.cluster_create` makes), or refused with a ValidationError whose keys are the
request's field names and whose messages say what to write instead.

Every rule of a new cluster is here: the name (format; no active cluster of the owner's
with it), the GPU model or CPU-only type and whether the registered hosts could ever
hold the shape (nodes, GPUs per node, network, zone), the image (a catalog image, one of
the owner's own, or another reference, never one of another researcher's in Suanli's
registry; a catalog image only where a host has it or can pull it: catalog.availability),
volumes and /pub, SSH keys, the release policy (never, by default: a cluster stays until
its owner stops or releases it), and the balance (through the caller's `funds`, since
billing sits above jobs). The HTML form parses its fields itself
and asks for the rest (`parsed=True`); the API gives its JSON as it came and the
request checks each field's shape too, with the same words Django's form fields use.

Field names, as both callers know them: name, resource ("gpu:<slug>" or "cpu:<type
name>"), nodes, gpus_per_node, image (a catalog `Image`, an `OwnImage` of the owner's,
or `CUSTOM`), custom_image (the reference typed with `CUSTOM`), network, zone, spot,
volumes (lines of storage-folder:/container/path[:ro]), pub, ssh_keys, workspace,
release_policy, idle_minutes, and the scheduled and idle shutdown (定时关机): stop_at,
stop_idle_minutes, stop_idle_below; "__all__" for the cluster as a whole (the balance).
`ShutdownRequest` checks those three alone for a cluster that exists (its page's form, the
API's /shutdown, the CLI), by the same rules and words.

Layer: clusters, under services (which makes what it returns); uses placement (fleet: what the
hosts offer), files (storage, pub), models and base (validators). The balance is asked through
`funds=`, since billing sits above jobs.
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, timedelta
from typing import Any, Protocol

from django import forms
from django.conf import settings
from django.core.exceptions import NON_FIELD_ERRORS, ValidationError
from django.utils import timezone
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy, gettext_noop

from jobs.base import validators
from jobs.files import pub, storage
from jobs.files.storage import VolumeSpec
from jobs.models import Cluster, GpuModel, Image, InstanceType, OwnImage, Pool, SshKey
from jobs.placement import catalog, fleet

CUSTOM = "custom"  # the image is the reference in custom_image
NAME_MAX = 63
CUSTOM_IMAGE_MAX = 255
IDLE_MINUTES_MAX = 7 * 24 * 60
ACTIVE = [Cluster.State.PENDING, Cluster.State.RUNNING, Cluster.State.PREEMPTING]
STOP_IDLE_MINUTES = (10, 1440)  # a stop after N idle minutes: from 10 minutes to a day
STOP_IDLE_BELOW = (1, 100)  # ... with every GPU under this percent
SHUTDOWN_FIELDS = ("stop_at", "stop_idle_minutes", "stop_idle_below")
STOP_AT_MOST = timedelta(days=366)  # a scheduled stop within a year


@dataclass(frozen=True)
class ClusterSpec:
    """A checked cluster: what `services.cluster_create` makes (a pool's clusters and the
    tests build one directly)."""

    name: str
    nodes: int
    gpu_model: GpuModel | None = None
    gpus_per_node: int = 0
    instance_type: InstanceType | None = None
    image: Image | None = None
    image_reference: str = ""
    own_image: OwnImage | None = None  # one of the owner's own images: image_reference is its
    network: str = Cluster.Network.STANDARD
    zone: str = ""
    spot: bool = False
    volumes: tuple[VolumeSpec, ...] = ()
    pub: bool = False  # the public datasets read-only at /pub (jobs/files/pub.py)
    ssh_keys: tuple[SshKey, ...] = ()
    workspace: bool = True
    release_policy: str = Cluster.ReleasePolicy.NEVER
    idle_minutes: int | None = None
    pool: Pool | None = None  # one of a pool's clusters (jobs/pools/autoscaler.py)
    stop_at: Any = None  # an aware datetime: stopped then, once (jobs/clusters/shutdown.py)
    stop_idle_minutes: int | None = None  # stopped after this long with every GPU under
    stop_idle_below: int | None = None  # ... this percent (both or neither)
    budget: Any = None  # a Decimal: stopped at this much spent (billing/budgets.py)


class Funds(Protocol):
    """What the caller's balance check answers (console.forms.Funds): whether the balance
    is short, and the refusal's words with the amounts."""

    @property
    def short(self) -> bool: ...

    def refusal(self, message: str, **extra) -> str: ...

    def as_context(self) -> dict: ...


# funds(gpu_model=, instance_type=, units=, spot=): None when the shape has no price.
FundsCheck = Callable[..., Funds | None]


class KeyChoices(forms.ModelMultipleChoiceField):
    """Ids are ASCII digits within the 64-bit keys: anything else ("²", an id past 2**63)
    is an invalid choice before the database sees it, which SQLite would answer with
    OverflowError (a 500)."""

    def _check_values(self, value):
        for pk in value:
            text = str(pk)
            if not (text.isascii() and text.isdigit()) or len(text) > 19 or int(text) >= 2**63:
                raise ValidationError(
                    self.error_messages["invalid_choice"],
                    code="invalid_choice",
                    params={"value": pk},
                )
        return super()._check_values(value)


@dataclass
class Offer:
    """What the fleet and the catalog offer one owner now: read once, for a form's choices
    and for the checks of its request."""

    owner: Any
    gpu_models: dict[str, GpuModel]  # by slug
    instance_types: dict[str, InstanceType]  # by name
    capacity: dict[int, dict]  # fleet.gpu_capacity_by_model(): active hosts, free GPUs
    rooms: list  # fleet.host_rooms(): every registered host, what could ever fit
    zones: list[str]  # active hosts' zones
    rdma: bool  # an active RDMA host exists
    images: dict[str, Image]  # active catalog images by id (as text)
    own_images: list[OwnImage]  # the owner's, by name and tag
    # Where each catalog image can run now (catalog.availability), by image id.
    availability: dict[int, catalog.Availability] = field(default_factory=dict)
    # Whose SSH keys may be attached: the person asking (a team's member), else the owner.
    person: Any = None

    @classmethod
    def of(cls, owner, *, person=None) -> "Offer":
        images = {str(i.pk): i for i in Image.objects.filter(active=True)}
        return cls(
            owner=owner,
            person=person,
            capacity=fleet.gpu_capacity_by_model(),
            rooms=fleet.host_rooms(),
            gpu_models={m.slug: m for m in GpuModel.objects.all()},
            instance_types={t.name: t for t in InstanceType.objects.all()},
            images=images,
            availability=catalog.availability(images.values()),
            own_images=list(OwnImage.objects.filter(owner=owner).order_by("name", "tag")),
            zones=fleet.active_zones(),
            rdma=fleet.rdma_available(),
        )

    def resources(self) -> list[str]:
        return [f"gpu:{slug}" for slug in self.gpu_models] + [
            f"cpu:{name}" for name in self.instance_types
        ]

    def networks(self) -> list[str]:
        if not self.rdma:
            return [Cluster.Network.STANDARD]
        return [value for value, _label in Cluster.Network.choices]


def max_nodes_message() -> str:
    return _("At most %(most)s nodes per cluster.") % {"most": settings.SUANLI_MAX_NODES}


def image_by_reference(owner, reference: str) -> Image | OwnImage | str:
    """An image as the API names it, by its reference: a catalog image's, one of the
    owner's own images', or `CUSTOM` (any other: custom_image is the reference, checked
    like one typed in the form, which refuses another researcher's)."""
    image = Image.objects.filter(reference=reference, active=True).first()
    if image is not None:
        return image
    own = OwnImage.objects.filter(owner=owner, reference=reference.strip()).first()
    return own if own is not None else CUSTOM


@dataclass
class Checked:
    """A request's answer: the spec, or the refusals per field (in the order found)."""

    spec: ClusterSpec | None
    errors: dict[str, list]  # field (or "__all__") -> messages (str or ValidationError)
    gpu_model: GpuModel | None = None
    instance_type: InstanceType | None = None
    image: Image | None = None
    own_image: OwnImage | None = None
    reference: str = ""
    volumes: list[VolumeSpec] | None = None  # parsed, unless refused
    funds_short: dict | None = None  # the amounts, when the balance is short

    def error(self) -> ValidationError:
        return ValidationError({name: list(messages) for name, messages in self.errors.items()})


@dataclass
class ClusterRequest:
    """A new cluster as asked for (see the module's docstring for the fields). Not
    checked until `validate()` (or `check()`)."""

    owner: Any
    name: str | None = None
    resource: str | None = None
    nodes: int | None = None
    gpus_per_node: int | None = None
    image: Image | OwnImage | str | None = None
    custom_image: str | None = None
    network: str | None = Cluster.Network.STANDARD
    zone: str | None = ""
    spot: bool = False
    volumes: str | None = ""
    pub: bool = True
    ssh_keys: Any = ()  # the owner's SshKey rows (parsed) or their ids
    workspace: bool = True
    release_policy: str | None = Cluster.ReleasePolicy.NEVER
    idle_minutes: int | None = None
    stop_at: Any = None  # a datetime (the form's, parsed), or text (the API's JSON)
    stop_idle_minutes: int | None = None
    stop_idle_below: int | None = None
    # The caller parsed each field already (the HTML form: required, lengths, ranges,
    # choices) and `refused` names those it refused: their values are not used.
    parsed: bool = False
    refused: frozenset[str] = frozenset()
    # A cluster's name is unique among the owner's active clusters; a pool's clusters
    # take the pool's name, whose form checks its own.
    unique_name: bool = True
    _errors: dict[str, list] = field(default_factory=dict, init=False, repr=False)
    _values: dict[str, Any] = field(default_factory=dict, init=False, repr=False)

    FIELDS = (
        "name", "resource", "nodes", "gpus_per_node", "image", "custom_image", "network", "zone",
        "spot", "volumes", "pub", "ssh_keys", "workspace", "release_policy", "idle_minutes",
        *SHUTDOWN_FIELDS,
    )  # fmt: skip

    def validate(self, offer: Offer, *, funds: FundsCheck) -> ClusterSpec:
        """The spec, or ValidationError with a list of messages per field."""
        checked = self.check(offer, funds=funds)
        if checked.errors:
            raise checked.error()
        return checked.spec

    def check(self, offer: Offer, *, funds: FundsCheck) -> Checked:
        """Every rule, in the order the researcher reads them: each field's own (its shape
        unless parsed, then the name, the node count, the volumes), then the shape on the
        fleet, the image, the release policy, /pub, and last the balance. A refused field
        counts as not given in the rules after it."""
        self._errors, self._values = {}, {}
        if self.parsed:
            self._values = {
                name: getattr(self, name) for name in self.FIELDS if name not in self.refused
            }
        else:
            self._shapes(offer)
        self._field_rules()
        network = self._values.get("network") or Cluster.Network.STANDARD
        gpu_model, instance_type = self._resource(offer)
        if gpu_model is not None:
            self._gpu_shape(offer, gpu_model)
        elif instance_type is not None:
            self._cpu_shape(offer, instance_type)
        if network == Cluster.Network.RDMA and not offer.rdma:
            self._refuse("network", _("No RDMA host exists; choose standard networking."))
        image, own, reference = self._image(offer)
        self._release_policy()
        self._shutdown(gpu_model, instance_type)
        if self._values.get("pub") and (why := pub.volumes_refusal(self._get("volumes", ()))):
            self._refuse("volumes", why)
        funds_short = self._balance(funds, gpu_model, instance_type)
        checked = Checked(
            spec=None, errors=self._errors, gpu_model=gpu_model, instance_type=instance_type,
            image=image, own_image=own, reference=reference, funds_short=funds_short,
            volumes=self._values.get("volumes"),
        )  # fmt: skip
        if not self._errors and not self.refused:
            checked.spec = self._spec(gpu_model, instance_type, image, own, reference)
        return checked

    # -- steps ---------------------------------------------------------------------------

    def _refuse(self, name: str, message) -> None:
        """One refusal of a field (or NON_FIELD_ERRORS); the field counts as not given
        from now on, as a form's add_error takes it out of cleaned_data."""
        self._errors.setdefault(name, []).append(message)
        self._values.pop(name, None)

    def _get(self, name: str, default=None):
        value = self._values.get(name)
        return default if value is None else value

    def _shapes(self, offer: Offer) -> None:
        """Each field's shape, as the console's form fields check theirs (the same words):
        required, lengths, ranges, choices."""
        checks = {
            "name": forms.CharField(max_length=NAME_MAX),
            "resource": forms.ChoiceField(choices=[(r, r) for r in offer.resources()]),
            "nodes": forms.IntegerField(min_value=1),
            "gpus_per_node": forms.IntegerField(min_value=1, required=False),
            "custom_image": forms.CharField(max_length=CUSTOM_IMAGE_MAX, required=False),
            "network": forms.ChoiceField(choices=[(n, n) for n in offer.networks()]),
            "zone": forms.ChoiceField(
                required=False, choices=[("", "")] + [(z, z) for z in offer.zones]
            ),
            "volumes": forms.CharField(required=False),
            "ssh_keys": KeyChoices(
                queryset=SshKey.objects.filter(owner=offer.person or offer.owner), required=False
            ),
            "release_policy": forms.ChoiceField(choices=Cluster.ReleasePolicy.choices),
            "idle_minutes": forms.IntegerField(
                min_value=1, max_value=IDLE_MINUTES_MAX, required=False
            ),
            **shutdown_fields(),
        }
        for name in self.FIELDS:
            value = getattr(self, name)
            if name == "ssh_keys":
                value = [str(pk) for pk in value or ()]
            try:
                if name == "image":
                    if value is None:
                        raise ValidationError(
                            forms.Field.default_error_messages["required"], code="required"
                        )
                elif name in checks:
                    value = checks[name].clean(value)
                else:
                    value = bool(value)
            except ValidationError as exc:
                self._errors.setdefault(name, []).extend(exc.error_list)
            else:
                self._values[name] = value

    def _field_rules(self) -> None:
        """The rules of single fields beyond their shape: the name, the most nodes, the
        volumes (parsed into VolumeSpecs)."""
        if "name" in self._values:
            name = self._values["name"]
            try:
                validators.validate_host_name(name)
            except ValidationError:
                self._refuse(
                    "name", _("Use lower-case letters, digits and dashes, e.g. llama-ft-1.")
                )
            else:
                if (
                    self.unique_name
                    and Cluster.objects.filter(
                        owner=self.owner, name=name, state__in=ACTIVE
                    ).exists()
                ):
                    self._refuse("name", _("You have an active cluster with this name already."))
        if "nodes" in self._values and self._values["nodes"] > settings.SUANLI_MAX_NODES:
            self._refuse("nodes", max_nodes_message())
        if "volumes" in self._values:
            try:
                self._values["volumes"] = storage.parse_volumes(
                    self._values["volumes"] or "", root=storage.tenant_root(self.owner.pk)
                )
            except ValidationError as exc:
                self._errors.setdefault("volumes", []).extend(exc.error_list)
                del self._values["volumes"]

    def _resource(self, offer: Offer) -> tuple[GpuModel | None, InstanceType | None]:
        kind, _sep, key = (self._values.get("resource") or "").partition(":")
        gpu_model = offer.gpu_models.get(key) if kind == "gpu" else None
        instance_type = offer.instance_types.get(key) if kind == "cpu" else None
        if self._values.get("resource") and gpu_model is None and instance_type is None:
            self._refuse("resource", _("Unknown GPU model or instance type."))
        return gpu_model, instance_type

    def _gpu_shape(self, offer: Offer, gpu_model: GpuModel) -> None:
        """Whether the registered hosts could ever hold the GPU shape (down ones may come
        back; a request beyond them would wait for ever at the head of its line), in
        the zone and on the network asked for."""
        zone = self._values.get("zone") or ""
        network = self._values.get("network") or Cluster.Network.STANDARD
        nodes = self._values.get("nodes")
        gpus = self._values.get("gpus_per_node")
        cap = offer.capacity.get(gpu_model.pk)
        fit = fleet.largest_fit(gpu_model=gpu_model, network=network, zone=zone, rooms=offer.rooms)
        any_host = fleet.largest_fit(gpu_model=gpu_model, rooms=offer.rooms)
        if not any_host.largest:
            self._refuse(
                "resource",
                _("No host offers %(model)s; pick another model.") % {"model": gpu_model.name},
            )
        elif gpus is None:
            self._refuse("gpus_per_node", _("How many GPUs per node?"))
        elif cap and zone and zone not in cap["zones"]:
            self._refuse(
                "zone",
                _("No %(model)s host in %(zone)s; offered in: %(zones)s.")
                % {"model": gpu_model.name, "zone": zone, "zones": ", ".join(sorted(cap["zones"]))},
            )
        elif not fit.largest:
            if not (cap and network == Cluster.Network.RDMA):  # said below
                self._refuse("zone" if zone else "network", _no_host(gpu_model, network, zone))
        elif nodes and (why := fit.refusal(nodes=nodes, per_node=gpus)):
            self._refuse("gpus_per_node" if gpus > fit.largest else "nodes", why)
        if cap and network == Cluster.Network.RDMA:
            rdma_zones = cap["rdma_zones"]
            if not rdma_zones:
                self._refuse(
                    "network",
                    _("No RDMA host offers %(model)s; choose standard networking.")
                    % {"model": gpu_model.name},
                )
            elif zone and zone not in rdma_zones:
                self._refuse(
                    "zone",
                    _("RDMA %(model)s hosts are in %(zones)s only.")
                    % {"model": gpu_model.name, "zones": ", ".join(sorted(rdma_zones))},
                )

    def _cpu_shape(self, offer: Offer, instance_type: InstanceType) -> None:
        zone = self._values.get("zone") or ""
        network = self._values.get("network") or Cluster.Network.STANDARD
        nodes = self._values.get("nodes")
        fit = fleet.largest_fit(instance_type=instance_type, zone=zone, rooms=offer.rooms)
        if network == Cluster.Network.RDMA:
            self._refuse("network", _("CPU-only instances use standard networking."))
        elif nodes and (why := fit.refusal(nodes=nodes, per_node=instance_type.vcpus)):
            too_big = instance_type.vcpus > fit.largest
            self._refuse("resource" if too_big else "nodes", why)

    def _image(self, offer: Offer) -> tuple[Image | None, OwnImage | None, str]:
        """The image and the reference the cluster runs. Suanli's registry holds
        researchers' own images: a reference into it is one of this researcher's, or
        nothing (another's is as if it did not exist)."""
        chosen = self._values.get("image")
        if isinstance(chosen, Image):
            where = offer.availability.get(chosen.pk) or catalog.availability([chosen])[chosen.pk]
            if not where.runnable:
                self._refuse("image", where.refusal(chosen))
            return chosen, None, chosen.reference
        if isinstance(chosen, OwnImage):
            return None, chosen, chosen.reference
        if chosen != CUSTOM:
            return None, None, ""
        own = None
        reference = (self._values.get("custom_image") or "").strip()
        if not reference:
            self._refuse(
                "custom_image",
                _("Give the image reference, e.g. pytorch/pytorch:2.4.0-cuda12.1-cudnn9-runtime."),
            )
        elif validators.names_registry(reference):
            own = next((i for i in offer.own_images if i.reference == reference), None)
            if own is None:
                self._refuse(
                    "custom_image",
                    _("No image %(reference)s among your images.") % {"reference": reference},
                )
        else:
            try:
                validators.validate_custom_image_reference(
                    reference,
                    not_pulled=Image.objects.filter(pullable=False).values_list(
                        "reference", flat=True
                    ),
                )
            except ValidationError as exc:
                self._refuse("custom_image", exc.messages[0])
        return None, own, reference

    def _release_policy(self) -> None:
        policy = self._values.get("release_policy")
        if policy == Cluster.ReleasePolicy.IDLE and not self._values.get("idle_minutes"):
            self._refuse(
                "idle_minutes", _("After how many idle minutes should the cluster be released?")
            )

    def _shutdown(self, gpu_model, instance_type) -> None:
        if gpu_model is None and instance_type is None:
            return  # no shape to judge the idle rule by (refused already)
        refused = set(self._errors) | set(self.refused)  # said already, by the spec or the form
        given = {n: self._values.get(n) for n in SHUTDOWN_FIELDS if n not in refused}
        for name, message in shutdown_refusals(
            given, gpus=gpu_model is not None, workspace=bool(self._values.get("workspace"))
        ):
            self._refuse(name, message)

    def _balance(self, funds: FundsCheck, gpu_model, instance_type) -> dict | None:
        """The cluster must have a price, and the balance must cover a few minutes of it
        (the amounts are returned when it does not)."""
        if gpu_model is None and instance_type is None:
            return None
        per_node = (self._values.get("gpus_per_node") or 0) if gpu_model else 1
        units = (self._values.get("nodes") or 0) * per_node
        if not units:
            return None
        answer = funds(
            gpu_model=gpu_model, instance_type=instance_type, units=units,
            spot=bool(self._values.get("spot")),
        )  # fmt: skip
        if answer is None:
            self._refuse(
                "resource",
                _(
                    "%(resource)s has no price on the rate card yet; pick another or ask an operator."
                )
                % {"resource": (gpu_model or instance_type).name},
            )
            return None
        if not answer.short:
            return None
        self._refuse(NON_FIELD_ERRORS, answer.refusal(_(SHORT_BALANCE)))
        return answer.as_context()

    def _spec(self, gpu_model, instance_type, image, own, reference) -> ClusterSpec:
        v = self._values
        return ClusterSpec(
            name=v["name"],
            nodes=v["nodes"],
            gpu_model=gpu_model,
            gpus_per_node=v.get("gpus_per_node") or 0 if gpu_model else 0,
            instance_type=instance_type,
            image=image,
            image_reference=reference,
            own_image=own,
            network=v.get("network") or Cluster.Network.STANDARD,
            zone=v.get("zone") or "",
            spot=bool(v.get("spot")),
            volumes=tuple(v.get("volumes") or ()),
            pub=bool(v.get("pub")),
            ssh_keys=tuple(v.get("ssh_keys") or ()),
            workspace=bool(v.get("workspace")),
            release_policy=v.get("release_policy") or Cluster.ReleasePolicy.NEVER,
            idle_minutes=v.get("idle_minutes"),
            stop_at=v.get("stop_at"),
            stop_idle_minutes=v.get("stop_idle_minutes"),
            stop_idle_below=v.get("stop_idle_below"),
        )


def _no_host(gpu_model: GpuModel, network: str, zone: str) -> str:
    values = {"model": gpu_model.name, "zone": zone}
    if network == Cluster.Network.RDMA and zone:
        return _("No %(model)s host with RDMA in %(zone)s.") % values
    if network == Cluster.Network.RDMA:
        return _("No %(model)s host with RDMA.") % values
    if zone:
        return _("No %(model)s host in %(zone)s.") % values
    return _("No %(model)s host.") % values


# -- scheduled and idle shutdown (定时关机) -------------------------------------------------

# The balance refusal's words; its amounts: Funds.refusal (or a Text of it, said later).
SHORT_BALANCE = gettext_noop(
    "This cluster costs %(per_hour)s/h; creating it needs a balance for %(minutes)s minutes "
    "(%(needed)s). Your balance is %(balance)s: top up on the billing page."
)
MINUTES_RANGE = gettext_lazy("Give whole minutes from 10 to 1440 (a day).")
BELOW_RANGE = gettext_lazy("Give a GPU utilisation from 1 to 100 percent.")


class StopAtField(forms.DateTimeField):
    """A time, kept in UTC; one beyond what a datetime holds there is not a time."""

    def to_python(self, value):
        result = super().to_python(value)
        if result is None:
            return None
        try:
            return result.astimezone(UTC)
        except (OverflowError, ValueError):
            raise ValidationError(self.error_messages["invalid"], code="invalid") from None


def shutdown_fields() -> dict[str, forms.Field]:
    """The shapes of the three shutdown fields, for the spec and the console's forms alike
    (one set of words). A time without a zone is in the reader's (the API's: UTC)."""
    minutes, below = STOP_IDLE_MINUTES, STOP_IDLE_BELOW
    return {
        "stop_at": StopAtField(
            required=False,
            error_messages={
                "invalid": gettext_lazy("Give a date and time, e.g. 2026-12-06 23:00.")
            },
        ),
        "stop_idle_minutes": _ranged(minutes, MINUTES_RANGE),
        "stop_idle_below": _ranged(below, BELOW_RANGE),
    }


def _ranged(bounds: tuple[int, int], words) -> forms.IntegerField:
    """An optional whole number within `bounds`, every refusal in the same `words`."""
    return forms.IntegerField(
        required=False,
        min_value=bounds[0],
        max_value=bounds[1],
        error_messages={"invalid": words, "min_value": words, "max_value": words},
    )


def shutdown_refusals(values: dict, *, gpus: bool, workspace: bool, now=None) -> list:
    """(field, message) for each rule the parsed shutdown fields break: a time that has
    passed, half an idle rule, an idle rule without GPUs to watch, any stop of a cluster
    without workspaces (a stop would keep nothing)."""
    now = now or timezone.now()
    at, minutes, below = (values.get(n) for n in SHUTDOWN_FIELDS)
    out = []
    if at is not None and at <= now:
        shown = timezone.localtime(at).strftime("%Y-%m-%d %H:%M %Z")
        out.append(("stop_at", _("%(at)s has passed: give a time to come.") % {"at": shown}))
    elif at is not None and at > now + STOP_AT_MOST:
        out.append(("stop_at", _("Give a time within a year.")))
    if minutes is not None and below is None and "stop_idle_below" in values:
        out.append(("stop_idle_below", _("Give the GPU utilisation too: under how many percent?")))
    if below is not None and minutes is None and "stop_idle_minutes" in values:
        out.append(("stop_idle_minutes", _("Give the minutes too: for how long under it?")))
    if (minutes is not None or below is not None) and not gpus:
        out.append(
            (
                "stop_idle_minutes",
                _("This cluster has no GPUs whose utilisation could be watched: "
                  "schedule a stop at a time instead."),
            )
        )  # fmt: skip
    if (at is not None or minutes is not None) and not workspace:
        out.append(
            (
                "stop_at" if at is not None else "stop_idle_minutes",
                _("A cluster without workspaces keeps nothing when stopped: "
                  "its release policy ends it instead."),
            )
        )  # fmt: skip
    return out


@dataclass(frozen=True)
class Schedule:
    """A cluster's checked shutdown rules (None: no such rule)."""

    stop_at: Any = None
    stop_idle_minutes: int | None = None
    stop_idle_below: int | None = None

    @classmethod
    def of(cls, cluster: Cluster) -> "Schedule":
        return cls(*(getattr(cluster, n) for n in SHUTDOWN_FIELDS))


ENDED = (Cluster.State.RELEASING, Cluster.State.RELEASED, Cluster.State.FAILED)


@dataclass
class ShutdownRequest:
    """New shutdown rules for an existing cluster, whole (all three fields; None: no such
    rule), checked by the rules of a new cluster's. `parsed`: the caller's form parsed the
    fields (`refused` names those it refused); else they are checked as given (JSON)."""

    cluster: Cluster
    stop_at: Any = None
    stop_idle_minutes: Any = None
    stop_idle_below: Any = None
    parsed: bool = False
    refused: frozenset[str] = frozenset()

    def errors(self) -> tuple[Schedule | None, dict[str, list]]:
        errors: dict[str, list] = {}
        values: dict[str, Any] = {}
        checks = shutdown_fields()
        for name in SHUTDOWN_FIELDS:
            if name in self.refused:
                continue
            try:
                value = getattr(self, name)
                values[name] = value if self.parsed else checks[name].clean(value)
            except ValidationError as exc:
                errors.setdefault(name, []).extend(exc.messages)
        cluster = self.cluster
        if cluster.state in ENDED:
            errors.setdefault(NON_FIELD_ERRORS, []).append(
                _("%(name)s is %(state)s: there is nothing left to stop.")
                % {"name": cluster.name, "state": cluster.get_state_display()}
            )
        gpus = bool(cluster.gpus_per_node) and not cluster.is_cpu_only
        # The rules of the fields that parsed, beside the refusals of the others.
        for name, message in shutdown_refusals(values, gpus=gpus, workspace=cluster.workspace):
            errors.setdefault(name, []).append(message)
        if errors or self.refused:
            return None, errors
        return Schedule(*(values.get(n) for n in SHUTDOWN_FIELDS)), errors

    def validate(self) -> Schedule:
        schedule, errors = self.errors()
        if errors:
            raise ValidationError(errors)
        return schedule
