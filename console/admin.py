"""Third-party pages of the admin held to the house rule (console/powers.py): every power
is a permission of its own, and no permission is a way to get the others.

- django-axes' "Clean up expired attempts" named no permission, so any staff user who may
  view the access attempts could run it (and it failed with a 500: the request has no
  `axes_attempt_time` outside a log-in). Here it needs `axes.delete_accessattempt`.
- Django lets whoever may change users change their own permissions, staff and superuser
  status, and any account's password: `auth.change_user` would be every permission. Here
  only a superuser hands out powers (those fields, a group's permissions) or changes a
  staff account; others change researchers' accounts only."""

from axes.admin import AccessAttemptAdmin
from axes.conf import settings
from axes.models import AccessAttempt
from django.contrib import admin
from django.contrib.auth import get_user_model
from django.contrib.auth.admin import GroupAdmin, UserAdmin
from django.contrib.auth.models import Group
from django.utils import timezone
from django.utils.translation import gettext_lazy

from jobs.admin import ActionsNeedPermissions


class AccessAttempts(ActionsNeedPermissions, AccessAttemptAdmin):
    @admin.action(description=gettext_lazy("Clean up expired attempts"), permissions=["delete"])
    def cleanup_expired_attempts(self, request, queryset):
        request.axes_attempt_time = timezone.now()  # what axes' middleware sets on a log-in
        return AccessAttemptAdmin.cleanup_expired_attempts(self, request, queryset)


if settings.AXES_ENABLE_ADMIN and admin.site.is_registered(AccessAttempt):
    admin.site.unregister(AccessAttempt)
    admin.site.register(AccessAttempt, AccessAttempts)


POWERS = ("is_staff", "is_superuser", "groups", "user_permissions")


class Users(UserAdmin):
    def get_readonly_fields(self, request, obj=None):
        fields = tuple(super().get_readonly_fields(request, obj))
        return fields if request.user.is_superuser else (*fields, *POWERS)

    def _staff_account(self, request, obj) -> bool:
        """An account that holds any power (staff, superuser, a group, a permission) is a
        superuser's to change: its password reset by another would hand over its powers."""
        if obj is None or request.user.is_superuser:
            return False
        return (
            obj.is_staff or obj.is_superuser or obj.groups.exists() or obj.user_permissions.exists()
        )

    def has_change_permission(self, request, obj=None):
        return not self._staff_account(request, obj) and super().has_change_permission(request, obj)

    def has_delete_permission(self, request, obj=None):
        return not self._staff_account(request, obj) and super().has_delete_permission(request, obj)


class Groups(GroupAdmin):
    def get_readonly_fields(self, request, obj=None):
        fields = tuple(super().get_readonly_fields(request, obj))
        return fields if request.user.is_superuser else (*fields, "permissions")


for model, model_admin in ((get_user_model(), Users), (Group, Groups)):
    if admin.site.is_registered(model):
        admin.site.unregister(model)
    admin.site.register(model, model_admin)
