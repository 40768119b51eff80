from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import include, path

from console import views

admin.site.site_header = "Suanli operations"
admin.site.site_title = "Suanli admin"
admin.site.index_title = "Fleet, catalogs and accounts"

urlpatterns = [
    path("", views.dashboard, name="dashboard"),
    path("login/", auth_views.LoginView.as_view(redirect_authenticated_user=True), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("signup/", views.signup, name="signup"),
    path("ops/hosts/", views.ops_hosts, name="ops_hosts"),
    path("ops/hosts/<int:host_id>/check/", views.ops_host_check, name="ops_host_check"),
    path("healthz", views.healthz, name="healthz"),
    path("admin/rq/", include("django_rq.urls")),
    path("admin/", admin.site.urls),
]
