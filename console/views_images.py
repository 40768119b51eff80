"""Researchers' own images: the Images page (their images, quota, builds, the build form),
a build's page (its live log: console/consumers.py BuildLogConsumer), deleting an image,
and saving a node's workspace as an image. The work is jobs/images/builds.py's; every object is
looked up through its owner (jobs/placement/fleet.py), so another researcher's is 404. A
team's images are its own (request.actor's principal): every member sees and uses them,
members and above build and save, admins and the owner delete."""

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import ValidationError
from django.shortcuts import redirect, render
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy
from django.views.decorators.http import require_POST

from console.forms import ImageBuildForm, SaveImageForm, attach_errors, example_dockerfile
from jobs.images import builds
from jobs.nodes import registry
from jobs.placement import fleet
from jobs.tenancy.actors import Role

RECENT_BUILDS = 20
NO_REGISTRY = gettext_lazy(
    "Own images are off on this console: the operator has not configured an image registry "
    "(SUANLI_REGISTRY). Clusters run the catalog's images."
)


@login_required
def image_list(request):
    enabled = builds.enabled()
    actor = request.actor
    owner = actor.principal
    form = ImageBuildForm(request.POST or None, initial={"dockerfile": example_dockerfile()})
    if request.method == "POST":
        actor.require(Role.MEMBER)
        if not enabled:
            messages.error(request, NO_REGISTRY)
            return redirect("image_list")
        if form.is_valid():
            d = form.cleaned_data
            try:
                build = builds.build_create(
                    owner=owner, name=d["name"], tag=d["tag"], dockerfile=d["dockerfile"],
                    context=d["context"], build_args=d["build_args"],
                )  # fmt: skip
            except ValidationError as exc:
                attach_errors(form, exc)
            else:
                messages.success(
                    request,
                    _("Build of %(image)s queued.") % {"image": f"{build.name}:{build.tag}"},
                )
                return redirect("image_build", build_id=build.pk)
    own = list(fleet.own_images_for(actor))
    for image in own:  # at most the quota's count of images
        image.using = list(builds.clusters_using(image).order_by("name"))
    return render(
        request,
        "console/images.html",
        {
            "enabled": enabled,
            "no_registry": NO_REGISTRY,
            "form": form,
            "images": own,
            "quota": builds.quota(owner),
            "push_prefix": f"{registry.host()}/{registry.namespace(owner.pk)}/" if enabled else "",
            "builds": fleet.builds_for(actor)[:RECENT_BUILDS],
        },
        status=400 if request.method == "POST" else 200,  # posted and not queued: refused
    )


@login_required
@require_POST
def image_delete(request, image_id: int):
    image = fleet.own_image_for_user(request.actor, image_id)
    request.actor.require_change(image)
    label = f"{image.name}:{image.tag}"
    try:
        builds.delete(owner=request.actor.principal, image=image)
    except ValidationError as exc:
        messages.error(request, " ".join(exc.messages))
    else:
        messages.success(
            request, _("Image %(image)s deleted from the registry.") % {"image": label}
        )
    return redirect("image_list")


@login_required
def image_build(request, build_id: int):
    build = fleet.build_for_user(request.actor, build_id)
    lines = builds.log_lines(build)
    return render(
        request,
        "console/image_build.html",
        {
            "build": build,
            "progress": fleet.build_progress(build),
            "lines": lines,
            "last_seq": lines[-1][0] if lines else 0,
            "ws": f"/ws/images/builds/{build.pk}/log/",
        },
    )


@login_required
@require_POST
def node_save_image(request, cluster_id: int, index: int):
    """A node's workspace (its cluster running or stopped) pushed as one of the owner's
    images; the build page follows it."""
    cluster = fleet.cluster_to_use(request.actor, cluster_id)
    form = SaveImageForm(request.POST)
    if not form.is_valid():
        messages.error(
            request,
            _("Save as image: %(errors)s")
            % {
                "errors": " ".join(
                    f"{name}: {e}" for name, errs in form.errors.items() for e in errs
                )
            },
        )
        return redirect("cluster_detail", cluster_id=cluster.pk)
    try:
        build = builds.save_create(
            owner=request.actor.principal, cluster=cluster, node_index=index,
            name=form.cleaned_data["name"], tag=form.cleaned_data["tag"],
        )  # fmt: skip
    except ValidationError as exc:
        messages.error(request, _("Save as image: %(errors)s") % {"errors": " ".join(exc.messages)})
        return redirect("cluster_detail", cluster_id=cluster.pk)
    messages.success(
        request,
        _("Saving node %(index)s of %(cluster)s as %(image)s.")
        % {"index": index, "cluster": cluster.name, "image": f"{build.name}:{build.tag}"},
    )
    return redirect("image_build", build_id=build.pk)
