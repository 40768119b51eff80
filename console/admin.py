"""Third-party pages of the admin held to the house rule (console/powers.py): every admin
action needs a permission of its own, a staff user without it is refused with 403.

django-axes' "Clean up expired attempts" named no permission, so any staff user who may
view the access attempts could run it (and it failed with a 500: the request has no
`axes_attempt_time` outside a log-in). Here it needs `axes.delete_accessattempt`."""

from axes.admin import AccessAttemptAdmin
from axes.conf import settings
from axes.models import AccessAttempt
from django.contrib import admin
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
