from django.conf import settings


def suanli(request):
    context = {"signup_enabled": settings.SUANLI_SIGNUP_ENABLED}
    user = getattr(request, "user", None)
    if user is not None and user.is_authenticated:
        from billing import selectors as money

        # Every page warns when less than an hour of balance is left at the current burn.
        standing = money.standing(user)
        context["my_standing"] = standing  # the dashboard shows the balance from this
        if standing.low:
            context["low_balance"] = standing
    return context
