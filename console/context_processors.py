from django.conf import settings

from billing import selectors as money
from console.admin_site import may_operate


def suanli(request):
    context = {"signup_enabled": settings.SUANLI_SIGNUP_ENABLED}
    user = getattr(request, "user", None)
    # A polled part of a page (htmx: the job and cluster status, the live cost) has no
    # banner: it would pay for the balance on every poll.
    # The navigation's operator part (and the admin's link): a power, never staff alone.
    context["may_operate"] = user is not None and user.is_authenticated and may_operate(user)
    if user is not None and user.is_authenticated and not request.headers.get("HX-Request"):
        # Every page warns when the balance lasts less than the researcher's threshold at
        # the current burn (billing.selectors.Standing.low: their own N hours, else the
        # operator's SUANLI_LOW_BALANCE_HOURS), and says so when it is used up.
        standing = money.standing(user)
        context["my_standing"] = standing  # the dashboard shows the balance from this
        if standing.low:
            context["low_balance"] = standing
    return context
