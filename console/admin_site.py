"""The Django admin's site: staff status alone opens nothing (docs/operator/permissions.md).
Django lets any active staff user into the admin's index (an empty one without
permissions); here the admin, like every operator page, needs a power: a permission of any
app, or superuser. Staff without one get the admin's log-in page ("not authorised")."""

from django.contrib.admin import AdminSite
from django.contrib.admin.apps import AdminConfig


def may_operate(user) -> bool:
    """Staff holding at least one permission (superusers hold all): who sees the operator
    part of the navigation and may open the admin."""
    return bool(
        user.is_active and user.is_staff and (user.is_superuser or user.get_all_permissions())
    )


class SuanliAdminSite(AdminSite):
    def has_permission(self, request) -> bool:
        return may_operate(request.user)


class SuanliAdminConfig(AdminConfig):
    default_site = "console.admin_site.SuanliAdminSite"
