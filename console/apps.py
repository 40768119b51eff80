from django.apps import AppConfig


class ConsoleConfig(AppConfig):
    name = "console"

    def ready(self) -> None:
        # The settings' checks of the apps' origins, and the log-out hook that ends the
        # apps' sessions (console/app_origin.py): both register on import.
        from console import app_origin, checks  # noqa: F401 (registered on import)
