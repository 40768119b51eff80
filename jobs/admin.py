"""The fleet in the Django admin. Operators' actions on running work are permissions of
their own (jobs.Host / jobs.Cluster Meta): drain_host (drain and undrain), reclaim_spot,
preempt_cluster, release_cluster; checking an engine needs change_host; a team's fair share
and GPU limit need manage_teams (its members and invitations are the team's own: read-only). Staff who may only
view see no such action, and posting one anyway is refused with 403. Jobs are read-only
here (view_job): their owners start and stop them.

Layer: admin, the top of jobs/ (beside tasks, management and apps). Uses the clusters' and
hosts' services for every write, the hosts' form, files (pub) and models."""

from django.contrib import admin, messages
from django.contrib.auth import get_user_model
from django.core.exceptions import PermissionDenied, ValidationError
from django.core.paginator import Paginator
from django.db import connections
from django.db.models import Count
from django.shortcuts import get_object_or_404, redirect
from django.template.defaultfilters import filesizeformat
from django.urls import path, reverse
from django.utils.functional import cached_property
from django.utils.html import format_html
from django.utils.http import urlencode
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy, ngettext
from django.views.decorators.http import require_POST

from jobs.clusters import services
from jobs.files import pub
from jobs.hosts import services as host_services
from jobs.hosts.forms import HostForm
from jobs.models import (
    Cluster,
    ClusterEvent,
    GpuModel,
    GpuSlot,
    Host,
    Image,
    ImageBuild,
    InstanceType,
    Job,
    JobEvent,
    Node,
    OwnImage,
    Pool,
    PoolEvent,
    PublicDataset,
    SshKey,
    Sweep,
    Team,
    TeamInvite,
    TeamMember,
)


def _an_id(text: str) -> bool:
    """Digits that int() takes and a key can be ("²".isdigit() is true; int() refuses it)."""
    return text.isdecimal() and len(text) <= 19


def report_check(request, host: Host) -> None:
    if host.state == Host.State.DOWN:
        messages.error(
            request,
            _("Host %(name)s did not answer: %(error)s")
            % {"name": host.name, "error": host.last_error},
        )
    elif host.state == Host.State.DEGRADED:
        messages.error(
            request,
            _("Host %(name)s answers but is degraded: %(error)s")
            % {"name": host.name, "error": host.last_error_shown},
        )
    else:
        kind = _("emulated GPUs") if host.emulated_gpu else _("NVIDIA runtime")
        messages.success(
            request,
            _(
                "Host %(name)s is %(state)s: Docker %(docker)s, %(cpus)s CPUs, %(memory)s GB, "
                "%(kind)s."
            )
            % {
                "name": host.name,
                "state": host.get_state_display(),
                "docker": host.docker_version,
                "cpus": host.cpu_count,
                "memory": host.memory_gb,
                "kind": kind,
            },
        )


class ActionsNeedPermissions:
    """Django leaves an action out of the menu for staff without its permission and answers
    a posted one with "No action selected"; here the post is refused outright (403)."""

    def changelist_view(self, request, extra_context=None):
        name = request.POST.get("action", "") if request.method == "POST" else ""
        known = {a if isinstance(a, str) else a.__name__ for a in self.actions or ()}
        if name in known and name not in self.get_actions(request):
            raise PermissionDenied(
                _("You may not run '%(action)s' on %(models)s.")
                % {"action": name, "models": self.opts.verbose_name_plural}
            )
        return super().changelist_view(request, extra_context)


@admin.register(Host)
class HostAdmin(ActionsNeedPermissions, admin.ModelAdmin):
    form = HostForm
    change_form_template = "admin/jobs/host/change_form.html"
    list_display = [
        "name",
        "zone",
        "gpus",
        "state_badge",
        "gpu_kind",
        "docker_version",
        "last_seen",
    ]
    list_filter = ["state", "zone", "gpu_model", "rdma", "emulated_gpu", "build_host"]
    search_fields = ["name", "address", "engine_url"]
    actions = ["check_now", "drain", "undrain", "reclaim_spot"]
    readonly_fields = [
        "state",
        "drain_requested",
        "emulated_gpu",
        "docker_version",
        "storage_driver",
        "root_disk_enforced",
        "operating_system",
        "cpu_count",
        "memory_bytes",
        "network",
        "last_checked",
        "last_seen",
        "last_error",
    ]
    fieldsets = [
        (None, {"fields": ["name", "engine_url", "address", "zone"]}),
        (gettext_lazy("GPUs"), {"fields": ["gpu_model", "gpu_count", "rdma"]}),
        (gettext_lazy("Images"), {"fields": ["build_host"]}),
        (
            gettext_lazy("TLS (tcp:// engines)"),
            {
                "fields": ["tls_ca", "tls_cert", "tls_key"],
                "description": gettext_lazy("PEM text of the engine's client TLS files."),
            },
        ),
        (gettext_lazy("Health (from the last check)"), {"fields": readonly_fields}),
    ]

    def get_queryset(self, request):
        return (
            super()
            .get_queryset(request)
            .select_related("gpu_model")
            .annotate(slot_total=Count("slots"))
        )

    @admin.display(description=gettext_lazy("GPUs"))
    def gpus(self, host: Host) -> str:
        return f"{host.gpu_count} x {host.gpu_model}" if host.gpu_model_id else _("CPU only")

    @admin.display(description=gettext_lazy("state"), ordering="state")
    def state_badge(self, host: Host) -> str:
        return format_html(
            '<span class="badge badge-{}">{}</span>', host.state, host.get_state_display()
        )

    @admin.display(description=gettext_lazy("GPU kind"), boolean=False)
    def gpu_kind(self, host: Host) -> str:
        return _("emulated") if host.emulated_gpu else "NVIDIA"

    def save_model(self, request, obj, form, change):
        host_services.host_save(host=obj)

    def response_post_save_add(self, request, obj):
        report_check(request, host_services.host_check(host_id=obj.pk))
        return super().response_post_save_add(request, obj)

    def response_post_save_change(self, request, obj):
        report_check(request, host_services.host_check(host_id=obj.pk))
        return super().response_post_save_change(request, obj)

    def get_urls(self):
        urls = super().get_urls()
        check = require_POST(self.admin_site.admin_view(self.check_view))
        return [path("<int:host_id>/check/", check, name="jobs_host_check"), *urls]

    def check_view(self, request, host_id: int):
        if not self.has_change_permission(request):
            raise PermissionDenied(_("Checking a host needs jobs.change_host."))
        host = get_object_or_404(Host, pk=host_id)
        report_check(request, host_services.host_check(host_id=host.pk))
        return redirect(reverse("admin:jobs_host_change", args=[host.pk]))

    @admin.display(description=gettext_lazy("network"))
    def network(self, host: Host) -> str:
        return host.network_note if host.last_seen else "—"

    def has_drain_permission(self, request) -> bool:
        return request.user.has_perm("jobs.drain_host")

    def has_reclaim_permission(self, request) -> bool:
        return request.user.has_perm("jobs.reclaim_spot")

    @admin.action(description=gettext_lazy("Check now"), permissions=["change"])
    def check_now(self, request, queryset):
        for host in queryset:
            report_check(request, host_services.host_check(host_id=host.pk))

    @admin.action(description=gettext_lazy("Drain (no new placements)"), permissions=["drain"])
    def drain(self, request, queryset):
        for host in queryset:
            host_services.host_set_draining(host=host, draining=True)
        count = queryset.count()
        messages.success(
            request,
            ngettext(
                "Draining %(count)s host(s); what runs on them stays.",
                "Draining %(count)s host(s); what runs on them stays.",
                count,
            )
            % {"count": count},
        )

    @admin.action(description=gettext_lazy("Bring back from draining"), permissions=["drain"])
    def undrain(self, request, queryset):
        for host in queryset:
            host_services.host_set_draining(host=host, draining=False)
        count = queryset.count()
        messages.success(
            request,
            ngettext(
                "%(count)s host(s) take new work again.",
                "%(count)s host(s) take new work again.",
                count,
            )
            % {"count": count},
        )

    @admin.action(
        description=gettext_lazy("Reclaim spot capacity (preempt its spot clusters)"),
        permissions=["reclaim"],
    )
    def reclaim_spot(self, request, queryset):
        preempted: list[str] = []
        for host in queryset:
            preempted += [
                c.name for c in host_services.host_reclaim_spot(host=host, by=request.user.username)
            ]
        if preempted:
            messages.success(
                request,
                ngettext(
                    "Preempting %(count)s spot cluster(s): %(names)s. They wait in the queue "
                    "again once their jobs have stopped.",
                    "Preempting %(count)s spot cluster(s): %(names)s. They wait in the queue "
                    "again once their jobs have stopped.",
                    len(preempted),
                )
                % {"count": len(preempted), "names": ", ".join(preempted)},
            )
        else:
            messages.info(request, _("No running spot cluster on the selected host(s)."))


@admin.register(GpuSlot)
class GpuSlotAdmin(admin.ModelAdmin):
    list_display = ["__str__", "host", "index"]
    list_filter = ["host__zone", "host"]

    def has_add_permission(self, request):
        return False  # slots follow the host's GPU count


@admin.register(GpuModel)
class GpuModelAdmin(admin.ModelAdmin):
    list_display = ["name", "memory_gb", "bf16", "nvlink", "root_disk_gb"]
    prepopulated_fields = {"slug": ["name"]}


@admin.register(InstanceType)
class InstanceTypeAdmin(admin.ModelAdmin):
    list_display = ["name", "vcpus", "memory_gb", "root_disk_gb", "description"]


@admin.register(Image)
class ImageAdmin(admin.ModelAdmin):
    list_display = ["name", "reference", "framework", "cuda_version", "active", "pullable", "apps"]
    list_filter = ["active", "pullable", "framework"]
    search_fields = ["name", "reference"]


class EstimatedCountPaginator(Paginator):
    """The admin's paginator for tables of millions of rows (the ledger, jobs): an
    unfiltered list takes its row count from PostgreSQL's statistics (`pg_class.reltuples`,
    kept by autovacuum and ANALYZE) instead of a `COUNT(*)` that reads the whole table. A
    filtered list, a small table and SQLite count exactly."""

    EXACT_BELOW = 10_000

    @cached_property
    def count(self) -> int:
        qs = self.object_list
        db = connections[getattr(qs, "db", "default")]
        if db.vendor == "postgresql" and hasattr(qs, "query") and not qs.query.where:
            with db.cursor() as cursor:
                cursor.execute(
                    "SELECT reltuples::bigint FROM pg_class WHERE oid = %s::regclass",
                    [qs.model._meta.db_table],
                )
                row = cursor.fetchone()
            if row and row[0] >= self.EXACT_BELOW:
                return row[0]
        return super().count


class ReadOnlyAdmin(admin.ModelAdmin):
    """Written by the services only: operators look, never add, change or delete."""

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


@admin.register(OwnImage)
class OwnImageAdmin(ReadOnlyAdmin):
    """Researchers' own images (jobs/images/builds.py): they delete them on their Images page."""

    list_display = ["reference", "owner", "size_bytes", "source", "updated_at"]
    list_filter = ["source"]
    search_fields = ["reference", "owner__username"]


@admin.register(ImageBuild)
class ImageBuildAdmin(ReadOnlyAdmin):
    list_display = ["id", "owner", "kind", "name", "tag", "state", "host", "created_at"]
    list_filter = ["state", "kind", "host"]
    search_fields = ["name", "owner__username"]
    exclude = ["log"]
    readonly_fields = ["log_end"]

    @admin.display(description=gettext_lazy("log (its end)"))
    def log_end(self, obj):
        return obj.log[-20000:]


class ReadOnlyInline(admin.TabularInline):
    """A timeline or a list of rows the services write: shown, never edited here."""

    extra = 0
    can_delete = False

    def has_add_permission(self, request, obj=None):
        return False


class NodeInline(ReadOnlyInline):
    model = Node
    fields = [
        "index",
        "host",
        "gpu_indices",
        "vcpus",
        "placed_at",
        "started_at",
        "preempted_at",
        "released_at",
    ]
    readonly_fields = fields


class ClusterEventInline(ReadOnlyInline):
    model = ClusterEvent
    fields = ["at", "kind", "message"]
    readonly_fields = fields


@admin.register(Cluster)
class ClusterAdmin(ActionsNeedPermissions, admin.ModelAdmin):
    """Operators look at clusters here; they change them only through the actions."""

    list_display = ["name", "owner", "shape", "state", "zone", "spot", "created_at"]
    list_filter = ["state", "gpu_model", "spot", "network"]
    search_fields = ["name", "owner__username"]
    inlines = [NodeInline, ClusterEventInline]
    actions = ["release", "preempt"]
    list_select_related = ["owner", "gpu_model", "instance_type"]

    def has_add_permission(self, request):
        return False  # clusters are requested by researchers, through the console or API

    def has_change_permission(self, request, obj=None):
        return False

    def has_release_permission(self, request) -> bool:
        return request.user.has_perm("jobs.release_cluster")

    def has_preempt_permission(self, request) -> bool:
        return request.user.has_perm("jobs.preempt_cluster")

    @admin.action(
        description=gettext_lazy("Release (give the capacity back now)"), permissions=["release"]
    )
    def release(self, request, queryset):
        for cluster in queryset:
            services.cluster_release(
                cluster=cluster, reason=f"released by operator {request.user.username}"
            )
        count = queryset.count()
        messages.success(
            request,
            ngettext("Released %(count)s cluster(s).", "Released %(count)s cluster(s).", count)
            % {"count": count},
        )

    @admin.action(description=gettext_lazy("Preempt (spot clusters only)"), permissions=["preempt"])
    def preempt(self, request, queryset):
        preempted, skipped = [], []
        for cluster in queryset:
            done = services.cluster_preempt(
                cluster=cluster, reason=f"preempted by {request.user.username} from the admin"
            )
            if done:
                preempted.append(cluster.name)
            else:
                cluster.refresh_from_db(fields=["state"])
                why = _("not spot") if not cluster.spot else cluster.get_state_display()
                skipped.append(_("%(cluster)s (%(why)s)") % {"cluster": cluster.name, "why": why})
        if preempted:
            messages.success(
                request,
                ngettext(
                    "Preempting %(count)s cluster(s): %(names)s.",
                    "Preempting %(count)s cluster(s): %(names)s.",
                    len(preempted),
                )
                % {"count": len(preempted), "names": ", ".join(preempted)},
            )
        if skipped:
            messages.warning(
                request,
                ngettext(
                    "Skipped %(count)s: %(names)s; only running spot clusters can be preempted.",
                    "Skipped %(count)s: %(names)s; only running spot clusters can be preempted.",
                    len(skipped),
                )
                % {"count": len(skipped), "names": ", ".join(skipped)},
            )


@admin.register(SshKey)
class SshKeyAdmin(admin.ModelAdmin):
    list_display = ["name", "owner", "key_type", "bits", "fingerprint", "created_at"]
    search_fields = ["owner__username", "fingerprint"]
    readonly_fields = ["key_type", "bits", "fingerprint"]


class TypedFilter(admin.SimpleListFilter):
    """A filter typed into a box, for a field with too many values to list as links: a
    year of a fleet's clusters runs to tens of thousands (one researcher had 2,000), and
    listing them would cost a query and a sidebar longer than the page."""

    template = "admin/jobs/typed_filter.html"
    placeholder = ""

    def lookups(self, request, model_admin):
        return [("", "")]  # one, so that the filter shows; the template draws the box

    def choices(self, changelist):
        yield {
            "value": self.value() or "",
            "placeholder": self.placeholder,
            "clear": changelist.get_query_string(remove=[self.parameter_name]),
            "keep": [(k, v) for k, v in changelist.params.items() if k != self.parameter_name],
        }


class JobClusterFilter(TypedFilter):
    title = gettext_lazy("cluster")
    parameter_name = "cluster"
    placeholder = gettext_lazy("cluster id, e.g. 812")

    def queryset(self, request, queryset):
        value = (self.value() or "").strip().lstrip("#")
        if not value:
            return queryset
        return queryset.filter(cluster_id=int(value)) if _an_id(value) else queryset.none()


class JobOwnerFilter(TypedFilter):
    title = gettext_lazy("owner")
    parameter_name = "owner"
    placeholder = gettext_lazy("username")

    def queryset(self, request, queryset):
        value = (self.value() or "").strip()
        if not value:
            return queryset
        # The owner's id first, so the list walks job_owner_recent_idx rather than a join.
        owner = get_user_model().objects.filter(username=value).values_list("pk", flat=True)
        return queryset.filter(owner_id=owner.first() or 0)


class JobEventInline(ReadOnlyInline):
    model = JobEvent
    fields = ["at", "kind", "message"]
    readonly_fields = fields


@admin.register(Job)
class JobAdmin(ReadOnlyAdmin):
    """Operators look jobs up here; nobody adds, changes or deletes one (their owners start
    and cancel them through the console or API). Built for a year of them: newest first
    along an index (jobs.Job Meta), sortable by nothing else, no full count and no facet
    counts, and the cluster and owner filters are typed rather than listed (TypedFilter).
    The job's environment is left out: it is its owner's, and may hold their tokens."""

    list_display = [
        "id",
        "name",
        "cluster_link",
        "owner_link",
        "state",
        "attempt",
        "created_at",
        "finished_at",
    ]
    list_display_links = ["id", "name"]
    list_filter = ["state", JobClusterFilter, JobOwnerFilter]
    list_select_related = ["cluster", "owner"]
    search_fields = ["name"]
    search_help_text = gettext_lazy("A job's id (4711 or #4711), or part of its name.")
    ordering = ["-created_at"]
    sortable_by = ["created_at"]
    show_full_result_count = False
    paginator = EstimatedCountPaginator
    show_facets = admin.ShowFacets.NEVER
    exclude = ["env"]
    inlines = [JobEventInline]

    def get_search_results(self, request, queryset, search_term):
        """A number is a job's id (its primary key: one row); anything else, part of a name."""
        term = search_term.strip().lstrip("#")
        if _an_id(term):
            return queryset.filter(pk=int(term)), False
        return super().get_search_results(request, queryset, search_term)

    @admin.display(description=gettext_lazy("cluster"))
    def cluster_link(self, job: Job) -> str:
        return format_html(
            '<a href="?{}" title="{}">{} (#{})</a>',
            urlencode({"cluster": job.cluster_id}),
            _("Jobs of this cluster only"),
            job.cluster.name,
            job.cluster_id,
        )

    @admin.display(description=gettext_lazy("owner"))
    def owner_link(self, job: Job) -> str:
        return format_html(
            '<a href="?{}" title="{}">{}</a>',
            urlencode({"owner": job.owner.username}),
            _("Jobs of this owner only"),
            job.owner.username,
        )


class PoolEventInline(ReadOnlyInline):
    model = PoolEvent
    fields = ["at", "kind", "message", "figures"]
    readonly_fields = fields


@admin.register(Pool)
class PoolAdmin(ReadOnlyAdmin):
    """Researchers' pools (jobs/pools/autoscaler.py): the queue, its clusters' shape and limits, and
    each decision of the autoscaler. Their owners create and close them in the console."""

    list_display = ["name", "owner", "shape", "min_clusters", "max_clusters", "spent", "state",
                    "created_at"]  # fmt: skip
    list_filter = ["state", "spot"]
    list_select_related = ["owner", "gpu_model", "instance_type"]
    search_fields = ["name", "owner__username"]
    inlines = [PoolEventInline]


@admin.register(Sweep)
class SweepAdmin(ReadOnlyAdmin):
    """Researchers' sweeps (jobs/pools/sweeps.py); their trials are jobs on the pool. The env
    is left out: it is its owner's, and may hold their tokens."""

    list_display = ["name", "owner", "pool", "metric", "direction", "trials", "pruner", "state",
                    "created_at"]  # fmt: skip
    list_filter = ["state", "pruner"]
    list_select_related = ["owner", "pool"]
    search_fields = ["name", "owner__username"]
    exclude = ["env"]


@admin.register(PublicDataset)
class PublicDatasetAdmin(ActionsNeedPermissions, admin.ModelAdmin):
    """Public datasets and models (jobs/files/pub.py). Adding one makes its draft folder (shown on
    its page); fill it on the storage server, or use `manage.py publish_dataset NAME SRC`,
    then publish it: from then on it is read-only at /pub/NAME in every cluster that asks
    for /pub. Publishing and unpublishing need jobs.publish_publicdataset; a published one
    is not deleted (unpublish it first), and deleting keeps its draft folder's files."""

    list_display = ["name", "kind", "size", "file_count", "published", "published_at"]
    list_filter = ["published", "kind"]
    search_fields = ["name", "description"]
    actions = ["publish", "unpublish", "measure"]
    fields = ["name", "kind", "description", "folder", "size", "file_count", "published",
              "published_at"]  # fmt: skip
    readonly_fields = ["folder", "size", "file_count", "published", "published_at"]

    def get_readonly_fields(self, request, obj=None):
        return [*self.readonly_fields, "name"] if obj is not None else self.readonly_fields

    def get_actions(self, request):
        actions = super().get_actions(request)
        actions.pop("delete_selected", None)  # one at a time, where a published one has none
        return actions

    def has_delete_permission(self, request, obj=None):
        return super().has_delete_permission(request, obj) and not (obj and obj.published)

    def has_publish_permission(self, request) -> bool:
        return request.user.has_perm("jobs.publish_publicdataset")

    @admin.display(description=gettext_lazy("size"), ordering="size_bytes")
    def size(self, obj):
        return "—" if obj.size_bytes is None else filesizeformat(obj.size_bytes)

    @admin.display(description=gettext_lazy("folder"))
    def folder(self, obj):
        if obj is None or obj.pk is None:
            return _("Made when you save: %(path)s") % {"path": pub.drafts_root() / "NAME"}
        return str(pub.folder(obj))

    def save_model(self, request, obj, form, change):
        if not change:
            pub.make_draft(obj.name)
        super().save_model(request, obj, form, change)

    def _each(self, request, queryset, work, done_words) -> None:
        done = []
        for dataset in queryset:
            try:
                work(dataset=dataset)
            except ValidationError as exc:
                messages.error(request, f"{dataset.name}: {' '.join(exc.messages)}")
            else:
                done.append(dataset.name)
        if done:
            messages.success(request, done_words % {"names": ", ".join(done)})

    @admin.action(description=gettext_lazy("Publish (read-only at /pub)"), permissions=["publish"])
    def publish(self, request, queryset):
        self._each(request, queryset, pub.dataset_publish, _("Published: %(names)s."))

    @admin.action(description=gettext_lazy("Unpublish (gone from /pub)"), permissions=["publish"])
    def unpublish(self, request, queryset):
        self._each(request, queryset, pub.dataset_unpublish, _("Unpublished: %(names)s."))

    @admin.action(description=gettext_lazy("Measure size again"), permissions=["change"])
    def measure(self, request, queryset):
        self._each(request, queryset, pub.dataset_measure, _("Measured: %(names)s."))


class TeamMemberInline(ReadOnlyInline):
    model = TeamMember
    fields = ["person", "role", "monthly_cap", "gpu_cap", "joined_at"]
    readonly_fields = fields


@admin.register(Team)
class TeamAdmin(admin.ModelAdmin):
    """Teams are made, joined and left by researchers (jobs/teams/services.py); an operator
    changes only the two figures that are theirs, fair share and GPU limit, and only with
    manage_teams (change_team alone is not enough: a team's weight is a power of its own)."""

    list_display = ["name", "principal", "share", "gpu_limit", "created_at"]
    search_fields = ["name", "principal__username", "memberships__person__username"]
    fields = ["name", "principal", "share", "gpu_limit", "created_at"]
    readonly_fields = ["name", "principal", "created_at"]
    inlines = [TeamMemberInline]
    list_select_related = ["principal"]

    def has_add_permission(self, request):
        return False  # a researcher makes a team: its principal account comes with it

    def has_delete_permission(self, request, obj=None):
        return False  # its account holds a ledger and clusters

    def has_change_permission(self, request, obj=None):
        return request.user.has_perm("jobs.manage_teams")


@admin.register(TeamMember)
class TeamMemberAdmin(ReadOnlyAdmin):
    """Roles and caps are the owner's (the team's pages, API and CLI); removal closes
    sessions at once there (jobs/teams/services.member_remove): never by deleting a row."""

    list_display = ["team", "person", "role", "monthly_cap", "gpu_cap", "joined_at"]
    list_filter = ["role"]
    search_fields = ["team__name", "person__username"]
    list_select_related = ["team", "person"]


@admin.register(TeamInvite)
class TeamInviteAdmin(ReadOnlyAdmin):
    """Open, used, revoked and expired invitations; a link's token is never stored (its
    digest is not shown either)."""

    list_display = ["team", "role", "login", "created_by", "created_at", "expires_at",
                    "accepted_at", "revoked_at"]  # fmt: skip
    exclude = ["digest"]
    search_fields = ["team__name", "login__username"]
    list_select_related = ["team", "login", "created_by"]
