"""Operators' powers are Django permissions, checked on every page, action, websocket and
admin view alike; staff status alone grants nothing (docs/operator/permissions.md). This module gates the
console's operator pages and django-rq's queue pages; other researchers' jobs are gated
where they are looked up (jobs.placement.fleet.job_for_user, cluster_charts_for_user), the
admin's actions by their `permissions` (jobs/admin.py, billing/admin.py).

A staff-only page answers 403 to staff without its permission (the page is known to
exist); someone who is not staff is sent to the admin's log-in, as Django's staff pages
do. An object of another researcher answers 404 instead, as to any researcher."""

from collections.abc import Callable

from django.contrib.admin.views.decorators import staff_member_required
from django.contrib.auth.decorators import permission_required
from django.urls import URLPattern, URLResolver
from django_rq import urls as rq_urls

# django-rq's pages clear queues, requeue and delete work: a power of its own.
MANAGE_QUEUES = "jobs.manage_queues"


def operator_required(*perms: str) -> Callable:
    """An operator page or action: staff holding every one of `perms`, else 403."""

    def decorate(view: Callable) -> Callable:
        return staff_member_required(permission_required(perms, raise_exception=True)(view))

    return decorate


def guarded(patterns: list, guard: Callable) -> list:
    """`patterns` (an included URLconf's) with every view wrapped in `guard`, nested
    includes too: so that no page or action of a third-party app is left out, whatever
    its own views check."""
    out = []
    for p in patterns:
        if isinstance(p, URLResolver):
            out.append(
                URLResolver(
                    p.pattern,
                    guarded(p.url_patterns, guard),
                    p.default_kwargs,
                    p.app_name,
                    p.namespace,
                )
            )
        else:
            out.append(URLPattern(p.pattern, guard(p.callback), p.default_args, p.name))
    return out


def queue_pages() -> tuple[list, str]:
    """django-rq's pages, for `include()`: each one, its JSON stats and its POST actions
    included, needs `jobs.manage_queues` (superusers hold every permission). django-rq's
    own copy inside the admin is switched off (RQ_SHOW_ADMIN_LINK) so that these are the
    only ones. Its token-authenticated stats (RQ_API_TOKEN) are not offered either."""
    return guarded(rq_urls.urlpatterns, operator_required(MANAGE_QUEUES)), rq_urls.app_name
