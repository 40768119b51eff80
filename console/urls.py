from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import include, path, re_path
from django.utils.translation import gettext_lazy

from console import (
    acting,
    api,
    metrics,
    views,
    views_account,
    views_apps,
    views_billing,
    views_budgets,
    views_hosts,
    views_images,
    views_monitoring,
    views_ops_teams,
    views_pools,
    views_pub,
    views_shutdown,
    views_storage,
    views_subscriptions,
    views_sweeps,
    views_teams,
    views_webhooks,
)
from console.powers import queue_pages

# A body Django refuses before any view runs is answered with a sentence (console/errors.py).
handler400 = "console.errors.bad_request"

# In the reader's language, as the rest of the admin (console.preferences.UserLocale).
admin.site.site_header = gettext_lazy("Suanli operations")
admin.site.site_title = gettext_lazy("Suanli admin")
admin.site.index_title = gettext_lazy("Fleet, catalogs and accounts")

urlpatterns = [
    path("", views.dashboard, name="dashboard"),
    path("login/", auth_views.LoginView.as_view(redirect_authenticated_user=True), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("signup/", views.signup, name="signup"),
    path("language/", views_account.set_language, name="set_language"),
    path("settings/", views_account.account_settings, name="account_settings"),
    path("acting/", acting.act_for, name="act_for"),
    path("teams/", views_teams.team_list, name="teams"),
    path("teams/join/<str:token>/", views_teams.team_join, name="team_join"),
    path(
        "teams/invitations/<int:invite_id>/answer/",
        views_teams.invite_answer,
        name="team_invite_answer",
    ),
    path("teams/<int:team_id>/", views_teams.team_detail, name="team_detail"),
    path("teams/<int:team_id>/rename/", views_teams.team_rename, name="team_rename"),
    path("teams/<int:team_id>/invite/", views_teams.team_invite, name="team_invite"),
    path(
        "teams/<int:team_id>/invitations/<int:invite_id>/revoke/",
        views_teams.team_invite_revoke,
        name="team_invite_revoke",
    ),
    path(
        "teams/<int:team_id>/members/<int:member_id>/role/",
        views_teams.member_role,
        name="team_member_role",
    ),
    path(
        "teams/<int:team_id>/members/<int:member_id>/caps/",
        views_teams.member_caps,
        name="team_member_caps",
    ),
    path(
        "teams/<int:team_id>/members/<int:member_id>/owner/",
        views_teams.member_owner,
        name="team_member_owner",
    ),
    path(
        "teams/<int:team_id>/members/<int:member_id>/remove/",
        views_teams.member_remove,
        name="team_member_remove",
    ),
    path("teams/<int:team_id>/leave/", views_teams.team_leave, name="team_leave"),
    path("storage/", views_storage.storage_page, name="storage"),
    path("clusters/", views.cluster_list, name="cluster_list"),
    path("clusters/new/", views.cluster_new, name="cluster_new"),
    path("clusters/<int:cluster_id>/", views.cluster_detail, name="cluster_detail"),
    path("clusters/<int:cluster_id>/status/", views.cluster_status, name="cluster_status"),
    path("clusters/<int:cluster_id>/release/", views.cluster_release, name="cluster_release"),
    path("clusters/<int:cluster_id>/resize/", views.cluster_resize, name="cluster_resize"),
    path("clusters/<int:cluster_id>/stop/", views.cluster_stop, name="cluster_stop"),
    path(
        "clusters/<int:cluster_id>/shutdown/",
        views_shutdown.cluster_shutdown,
        name="cluster_shutdown",
    ),
    path("clusters/<int:cluster_id>/budget/", views_budgets.cluster_budget, name="cluster_budget"),
    path(
        "clusters/<int:cluster_id>/shutdown/clear/",
        views_shutdown.cluster_shutdown_clear,
        name="cluster_shutdown_clear",
    ),
    path(
        "clusters/<int:cluster_id>/keys/attach/",
        views.cluster_key_attach,
        name="cluster_key_attach",
    ),
    path(
        "clusters/<int:cluster_id>/keys/<int:key_id>/detach/",
        views.cluster_key_detach,
        name="cluster_key_detach",
    ),
    path("clusters/<int:cluster_id>/start/", views.cluster_start, name="cluster_start"),
    path(
        "clusters/<int:cluster_id>/people/add/",
        views_teams.cluster_person_add,
        name="cluster_person_add",
    ),
    path(
        "clusters/<int:cluster_id>/people/<int:person_id>/remove/",
        views_teams.cluster_person_remove,
        name="cluster_person_remove",
    ),
    path("clusters/<int:cluster_id>/jobs/new/", views.job_new, name="job_new"),
    path("pools/", views_pools.pool_list, name="pool_list"),
    path("pools/new/", views_pools.pool_new, name="pool_new"),
    path("pools/<int:pool_id>/", views_pools.pool_detail, name="pool_detail"),
    path("pools/<int:pool_id>/status/", views_pools.pool_status, name="pool_status"),
    path("pools/<int:pool_id>/samples.json", views_pools.pool_samples, name="pool_samples"),
    path("pools/<int:pool_id>/jobs/new/", views_pools.pool_job_new, name="pool_job_new"),
    path("pools/<int:pool_id>/close/", views_pools.pool_close, name="pool_close"),
    path("sweeps/", views_sweeps.sweep_list, name="sweep_list"),
    path("sweeps/new/", views_sweeps.sweep_new, name="sweep_new"),
    path("sweeps/<int:sweep_id>/", views_sweeps.sweep_detail, name="sweep_detail"),
    path("sweeps/<int:sweep_id>/live/", views_sweeps.sweep_live, name="sweep_live"),
    path("sweeps/<int:sweep_id>/data.json", views_sweeps.sweep_data, name="sweep_data"),
    path("sweeps/<int:sweep_id>/cancel/", views_sweeps.sweep_cancel, name="sweep_cancel"),
    path("sweeps/<int:sweep_id>/budget/", views_budgets.sweep_budget, name="sweep_budget"),
    path(
        "clusters/<int:cluster_id>/nodes/<int:index>/terminal/",
        views.node_terminal,
        name="node_terminal",
    ),
    # The tiles of the workspace apps (console/views_apps.py); the apps themselves are on
    # origins of their own (console/app_origin.py), entered through `app_open`.
    path(
        "clusters/<int:cluster_id>/nodes/<int:index>/apps/<slug:kind>/open/",
        views_apps.app_open,
        name="app_open",
    ),
    # Where the apps were served before they had origins of their own: old bookmarks lead
    # their owner to the same path of the app's origin.
    re_path(
        r"^clusters/(?P<cluster_id>[0-9]{1,18})/nodes/(?P<index>[0-9]{1,3})"
        r"/(?P<kind>jupyter|tensorboard|service)(?P<rest>/.*)?$",
        views_apps.app_open_old,
    ),
    path(
        "clusters/<int:cluster_id>/nodes/<int:index>/apps/status/",
        views_apps.app_status,
        name="app_status",
    ),
    path(
        "clusters/<int:cluster_id>/nodes/<int:index>/apps/<slug:kind>/start/",
        views_apps.app_start,
        name="app_start",
    ),
    path(
        "clusters/<int:cluster_id>/nodes/<int:index>/apps/<slug:kind>/stop/",
        views_apps.app_stop,
        name="app_stop",
    ),
    path(
        "clusters/<int:cluster_id>/nodes/<int:index>/save-image/",
        views_images.node_save_image,
        name="node_save_image",
    ),
    path("images/", views_images.image_list, name="image_list"),
    path("public-data/", views_pub.public_data, name="public_data"),
    path("images/<int:image_id>/delete/", views_images.image_delete, name="image_delete"),
    path("images/builds/<int:build_id>/", views_images.image_build, name="image_build"),
    path("jobs/<int:job_id>/", views.job_detail, name="job_detail"),
    path("jobs/<int:job_id>/status/", views.job_status, name="job_status"),
    path("jobs/<int:job_id>/log/", views.job_log, name="job_log"),
    path("jobs/<int:job_id>/metrics.json", views_monitoring.job_metrics, name="job_metrics"),
    path("jobs/<int:job_id>/cancel/", views.job_cancel, name="job_cancel"),
    path("jobs/<int:job_id>/budget/", views_budgets.job_budget, name="job_budget"),
    path("jobs/<int:job_id>/profile/", views_monitoring.job_profile, name="job_profile"),
    path(
        "jobs/<int:job_id>/profile/<int:attempt>/<str:name>",
        views_monitoring.job_profile_file,
        name="job_profile_file",
    ),
    path("gpu-subscriptions/", views_subscriptions.subscription_list, name="gpu_subscriptions"),
    path(
        "gpu-subscriptions/<int:subscription_id>/cancel/",
        views_subscriptions.subscription_cancel,
        name="gpu_subscription_cancel",
    ),
    path("keys/", views.ssh_keys, name="ssh_keys"),
    path("keys/<int:key_id>/delete/", views.ssh_key_delete, name="ssh_key_delete"),
    path("keys/<int:key_id>/default/", views.ssh_key_default, name="ssh_key_default"),
    path("billing/", views_billing.billing, name="billing"),
    path("billing/ledger/", views_billing.billing_detail, name="billing_detail"),
    path("billing/transfer/", views_billing.billing_transfer, name="billing_transfer"),
    path(
        "billing/statement/<int:year>-<int:month>.csv",
        views_billing.billing_statement,
        name="billing_statement",
    ),
    path(
        "billing/statement/<int:year>-<int:month>-detail.csv",
        views_billing.billing_statement_detail,
        name="billing_statement_detail",
    ),
    path("clusters/<int:cluster_id>/cost/", views_billing.cluster_cost, name="cluster_cost"),
    path("ops/billing/", views_billing.ops_billing, name="ops_billing"),
    path("ops/billing/topup/", views_billing.ops_topup, name="ops_topup"),
    path("ops/queue/", views.ops_queue, name="ops_queue"),
    path("ops/teams/", views_ops_teams.ops_teams, name="ops_teams"),
    path("ops/teams/<int:team_id>/", views_ops_teams.ops_team, name="ops_team"),
    path("ops/hosts/<int:host_id>/drain/", views.ops_host_drain, name="ops_host_drain"),
    path("ops/hosts/<int:host_id>/reclaim/", views.ops_host_reclaim, name="ops_host_reclaim"),
    path("ops/hosts/", views.ops_hosts, name="ops_hosts"),
    path("ops/hosts/add/", views_hosts.ops_host_add, name="ops_host_add"),
    path(
        "ops/hosts/joins/<int:join_id>/revoke/",
        views_hosts.ops_host_join_revoke,
        name="ops_host_join_revoke",
    ),
    # What a joining host fetches and asks (jobs/hosts/scripts/join.sh): scripts public, the rest
    # for token and credential holders only (console/views_hosts.py).
    path("hosts/join.sh", views_hosts.join_script, name="host_join_script"),
    path("hosts/host-firewall.sh", views_hosts.firewall_script, name="host_firewall_script"),
    path("hosts/join/", views_hosts.join_api, name="host_join_api"),
    path("hosts/join/image/", views_hosts.join_image, name="host_join_image"),
    path("ops/fleet/", views_monitoring.ops_fleet, name="ops_fleet"),
    path("ops/fleet.json", views_monitoring.ops_fleet_data, name="ops_fleet_data"),
    path("ops/hosts/<int:host_id>/check/", views.ops_host_check, name="ops_host_check"),
    path("webhooks/", views_webhooks.endpoint_list, name="webhooks"),
    path("webhooks/<int:endpoint_id>/", views_webhooks.endpoint_detail, name="webhook_detail"),
    path("webhooks/<int:endpoint_id>/test/", views_webhooks.endpoint_test, name="webhook_test"),
    path(
        "webhooks/<int:endpoint_id>/rotate/", views_webhooks.endpoint_rotate, name="webhook_rotate"
    ),
    path(
        "webhooks/<int:endpoint_id>/delete/", views_webhooks.endpoint_delete, name="webhook_delete"
    ),
    path(
        "webhooks/deliveries/<int:delivery_id>/redeliver/",
        views_webhooks.delivery_redeliver,
        name="webhook_redeliver",
    ),
    path(
        "notifications/confirm/<int:endpoint_id>/<str:token>/",
        views_webhooks.confirm_address,
        name="notify_confirm",
    ),
    path("api/tokens/", api.tokens_page, name="api_tokens"),
    path("api/v1/", include("console.api_urls")),
    path("healthz", views.healthz, name="healthz"),
    # Prometheus: a token, an allowed scraper or console.view_metrics (console/metrics.py).
    path("metrics", metrics.metrics_view, name="metrics"),
    path("admin/rq/", include(queue_pages())),  # jobs.manage_queues on every page
    path("admin/", admin.site.urls),
]
