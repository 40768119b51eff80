"""The jobs app for Django.

Layer: apps, the top of jobs/ (beside tasks, admin and management); uses no other part.
"""

from django.apps import AppConfig


class JobsConfig(AppConfig):
    name = "jobs"
    verbose_name = "Engine: hosts, GPUs, images"
