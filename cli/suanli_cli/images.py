"""`suanli images`: your own images: list, build from a Dockerfile, delete."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import click

from suanli_cli.core import (
    BUILD_ENDED,
    POLL_S,
    Api,
    Failure,
    emit_json,
    group_json,
    json_option,
    table,
    wants_json,
    when,
)
from suanli_cli.main import cli

# images


@cli.group()
@json_option
@click.pass_context
def images(ctx, as_json):
    """Your own images: list, build from a Dockerfile, delete."""
    group_json(ctx, as_json)


def _size(n) -> str:
    """Decimal units, as the console shows them: 340 MB, 1.2 GB."""
    size = float(n or 0)
    if size < 1000:
        return f"{int(size)} B"
    for unit in ("kB", "MB", "GB", "TB", "PB"):
        size /= 1000
        text = f"{size:.1f}" if size < 99.95 else f"{size:.0f}"
        if float(text) < 1000 or unit == "PB":
            return f"{text.removesuffix('.0')} {unit}"
    return f"{n} B"


@images.command("list")
@json_option
def images_list(as_json):
    """Your images, the clusters using them, and your quota."""
    data = Api.from_config().get("images")
    if wants_json(as_json):
        emit_json(data)
        return
    rows = [
        {
            **i, "image": f"{i.get('name')}:{i.get('tag')}", "size": _size(i.get("size_bytes")),
            "created": when(i.get("created_at")),
            "used_by": ", ".join(str(c) for c in i.get("clusters") or []) or "-",
        }
        for i in data.get("images", [])
    ]  # fmt: skip
    table(
        rows,
        [("id", "ID"), ("image", "IMAGE"), ("size", "SIZE"), ("created", "CREATED"),
         ("used_by", "CLUSTERS"), ("reference", "REFERENCE")],
    )  # fmt: skip
    q = data.get("quota") or {}
    if not data.get("enabled", True):
        click.echo("Own images are off: the operator has configured no image registry.")
    else:
        click.echo(
            f"{q.get('count')} of {q.get('max_count')} images · {_size(q.get('bytes'))} of "
            f"{_size(q.get('max_bytes'))}"
        )


def _build_arg(ctx, param, values):
    args = {}
    for value in values:
        key, sep, val = value.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{value!r} is not KEY=VALUE.")
        args[key] = val
    return args


@images.command("build")
@click.argument("directory", type=click.Path(exists=True, file_okay=False), metavar="DIR")
@click.option("--name", required=True, help="The image's name, e.g. my-torch.")
@click.option("--tag", default="latest", show_default=True)
@click.option(
    "--context", metavar="STORAGE_FOLDER",
    help="One of your storage folders on the console, sent as the build's context.",
)  # fmt: skip
@click.option(
    "--build-arg", "build_args", multiple=True, callback=_build_arg, metavar="KEY=VALUE",
    help="A value for an ARG of the Dockerfile (repeatable).",
)  # fmt: skip
@click.option("--no-follow", is_flag=True, help="Queue it and exit; do not print its log.")
@json_option
def images_build(directory, name, tag, context, build_args, no_follow, as_json):
    """Build DIR/Dockerfile on the console's build host and push it as one of your images.

    The build context is not DIR but the storage folder of --context (upload files to it
    with scp or sftp first). Without --no-follow, the log is printed as it comes and the
    exit status is 1 when the build fails.
    """
    path = Path(directory) / "Dockerfile"
    try:
        dockerfile = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise Failure(f"cannot read {path}: {exc}") from None
    body = {"name": name, "tag": tag, "dockerfile": dockerfile, "build_args": build_args}
    if context:
        body["context"] = context
    api = Api.from_config()
    build = api.post("images/builds", "the build", body)
    as_json = wants_json(as_json)
    if no_follow:
        if as_json:
            emit_json(build)
        else:
            click.echo(
                f"Build {build['id']} of {name}:{tag} is {build['state']}: {build.get('url', '')}"
            )
        return
    if not as_json:
        click.echo(f"Build {build['id']} of {name}:{tag}: {build.get('url', '')}", err=True)
    after = 0
    while True:
        try:
            build = api.get(f"images/builds/{build['id']}", f"build {build['id']}", after=after)
        except Failure as exc:
            if exc.status != 429:
                raise
            time.sleep(5)  # the rate limit of this token: wait, then go on
            continue
        for line in build.get("lines", []):
            after = max(after, int(line.get("seq") or 0))
            if as_json:
                click.echo(json.dumps(line, ensure_ascii=False))
            else:
                click.echo(line.get("text", ""))
        if build.get("state") in BUILD_ENDED:
            break
        time.sleep(POLL_S)
    if build["state"] == "succeeded":
        if not as_json:
            click.echo(f"--- build {build['id']} succeeded: {build.get('image')} ---", err=True)
        return
    if as_json:  # the stream's last object says so, as every error under --json does
        words = f"build {build['id']} failed: {build.get('error')}"
        click.echo(json.dumps({"error": words, "build": build["id"]}, ensure_ascii=False))
    else:
        click.echo(f"--- build {build['id']} failed: {build.get('error')} ---", err=True)
    sys.exit(1)


@images.command("delete")
@click.argument("image_id", type=int, metavar="ID")
@json_option
def images_delete(image_id, as_json):
    """Delete one of your images from the registry (refused while a cluster uses it)."""
    Api.from_config().delete(f"images/{image_id}", f"image {image_id}")
    if wants_json(as_json):
        emit_json({"deleted": image_id})
        return
    click.echo(f"Image {image_id} deleted.")
