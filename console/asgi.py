import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")
django_asgi_app = get_asgi_application()

from channels.auth import AuthMiddlewareStack  # noqa: E402  (needs Django set up first)
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from channels.security.websocket import AllowedHostsOriginValidator  # noqa: E402

from console.preferences import ScopeLocale  # noqa: E402
from console.proxy import http_router, websocket_router  # noqa: E402
from console.routing import websocket_urlpatterns  # noqa: E402

application = ProtocolTypeRouter(
    {
        # By Host, before anything else: an app origin's requests and websockets go to the
        # workspace apps' proxy only (console/proxy.py, console/app_origin.py), never to
        # Django or the console's websockets; those refuse any Origin but the console's.
        "http": http_router(django_asgi_app),
        "websocket": websocket_router(
            AllowedHostsOriginValidator(
                AuthMiddlewareStack(ScopeLocale(URLRouter(websocket_urlpatterns)))
            )
        ),
    }
)
