from django.apps import AppConfig
from django.contrib.auth.signals import user_logged_in


class ConsoleConfig(AppConfig):
    name = "console"

    def ready(self):
        from console import preferences  # models are ready only now

        user_logged_in.connect(preferences.on_login, dispatch_uid="console.preferences")
