from django.conf import settings


def suanli(request):
    return {"signup_enabled": settings.SUANLI_SIGNUP_ENABLED}
