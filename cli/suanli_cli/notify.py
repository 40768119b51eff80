"""`suanli notify`: notification channels (通知渠道): webhooks, e-mail addresses and chat
robots that events are sent to. List, add, remove, send a test message, read the delivery
log; the same checks and limits as the console's Notifications page."""

from __future__ import annotations

import click

from suanli_cli.core import (
    Api,
    all_pages,
    emit_json,
    group_json,
    json_option,
    table,
    wants_json,
    when,
)
from suanli_cli.main import cli

KINDS = ("webhook", "email", "wecom", "dingtalk", "feishu", "slack", "discord")


@cli.group()
@json_option
@click.pass_context
def notify(ctx, as_json):
    """Notification channels: where events (job failed, balance low, ...) are sent."""
    group_json(ctx, as_json)


def _state(c: dict) -> str:
    if not c.get("confirmed"):
        return "waiting for confirmation"
    if not c.get("enabled"):
        return f"off: {c['disabled_reason']}" if c.get("disabled_reason") else "off"
    return "failing" if c.get("failing_since") else "on"


@notify.command("list")
@json_option
def notify_list(as_json):
    """Your channels, newest first."""
    rows = all_pages(Api.from_config(), "notification-channels", "notification_channels")
    if wants_json(as_json):
        emit_json({"notification_channels": rows, "count": len(rows)})
        return
    rows = [{**c, "state": _state(c), "takes": ", ".join(c.get("events", []))} for c in rows]
    table(rows, [("id", "ID"), ("kind", "KIND"), ("address", "ADDRESS"), ("state", "STATE"),
                 ("takes", "EVENTS")])  # fmt: skip


@notify.command("add")
@click.argument("kind", type=click.Choice(KINDS))
@click.argument("address")
@click.option("--event", "events", multiple=True, required=True,
              help="An event it takes, e.g. job.failed (repeat for more).")  # fmt: skip
@click.option("--secret", default=None, help="A DingTalk or Feishu robot's signing secret.")
@click.option("--disabled", is_flag=True, help="Add it turned off.")
@json_option
def notify_add(kind, address, events, secret, disabled, as_json):
    """Add a channel: KIND is webhook, email, wecom, dingtalk, feishu, slack or discord;
    ADDRESS its https URL, or the e-mail address (one other than your account's gets a
    confirmation link first). A webhook's signing secret is printed this once."""
    body = {"kind": kind, "address": address, "events": list(events), "enabled": not disabled}
    if secret is not None:
        body["secret"] = secret
    made = Api.from_config().post("notification-channels", "the channel", body)
    if wants_json(as_json):
        emit_json(made)
        return
    click.echo(f"Channel {made['id']}: {made['kind']} {made['address']}.")
    if made.get("secret"):
        click.echo(f"Signing secret (shown once, keep it): {made['secret']}")
    if made.get("confirmation_sent"):
        click.echo(
            f"A confirmation link is on its way to {made['address']}; nothing else is sent "
            "there until it is opened."
        )


@notify.command("remove")
@click.argument("channel_id", type=int, metavar="ID")
@json_option
def notify_remove(channel_id, as_json):
    """Delete a channel: it gets nothing more."""
    Api.from_config().delete(f"notification-channels/{channel_id}", f"channel {channel_id}")
    if wants_json(as_json):
        emit_json({"removed": channel_id})
        return
    click.echo(f"Channel {channel_id} removed.")


@notify.command("test")
@click.argument("channel_id", type=int, metavar="ID")
@json_option
def notify_test(channel_id, as_json):
    """Send a test message (an e-mail address not confirmed yet gets a new confirmation
    link instead); `suanli notify log ID` shows how it went."""
    sent = Api.from_config().post(
        f"notification-channels/{channel_id}/test", f"channel {channel_id}"
    )
    if wants_json(as_json):
        emit_json(sent)
        return
    click.echo(sent["message"])


@notify.command("log")
@click.argument("channel_id", type=int, metavar="ID")
@json_option
def notify_log(channel_id, as_json):
    """What was sent to a channel, newest first: event, words, state, attempts."""
    rows = all_pages(
        Api.from_config(), f"notification-channels/{channel_id}/deliveries", "deliveries"
    )
    if wants_json(as_json):
        emit_json({"deliveries": rows, "count": len(rows)})
        return
    rows = [{**d, "created_at": when(d.get("created_at"))} for d in rows]
    table(rows, [("created_at", "WHEN"), ("event", "EVENT"), ("state", "STATE"),
                 ("attempts", "ATTEMPTS"), ("last_status", "HTTP"), ("summary", "WHAT")])  # fmt: skip
