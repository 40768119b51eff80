"""The jobs app for Django.

Layer: apps, the top of jobs/ (beside tasks, admin and management); uses no other part.
"""

from django.apps import AppConfig
from django.utils.translation import gettext_lazy


class JobsConfig(AppConfig):
    name = "jobs"
    verbose_name = gettext_lazy("Engine: hosts, GPUs, images")
