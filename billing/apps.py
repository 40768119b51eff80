from django.apps import AppConfig
from django.utils.translation import gettext_lazy


class BillingConfig(AppConfig):
    name = "billing"
    verbose_name = gettext_lazy("Billing")
