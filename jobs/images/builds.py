"""Researchers' own images: built from a Dockerfile on a build host, or saved from a
workspace, pushed to the registry (jobs/nodes/registry.py) as `<registry>/u<owner>/<name>:<tag>`,
listed, counted against a quota, deleted.

A build runs on the queue "builds" (its own workers: a long build never holds up a job's
start), on a host the operator marked `build_host`, through the engine's build API
(the classic builder: no privileged step, no host mount), with the build limits of the
settings (CPU, memory, time; a build over its time is cut off and the engine removes its
step's container), on the build network (a bridge whose containers reach neither the host
nor the private networks). Its `FROM` (and `COPY --from`) may name only a catalog image,
one of the researcher's own images, or what SUANLI_BUILD_FROM_ALLOWED allows; anything
else is refused before the build, with the reason. The engine fetches nothing on a build's
behalf: ADD names files of the context only (never a URL, a git remote or a variable), the
engine gets a fixed set of build parameters, and the bases are on the host, checked, before
the build starts. A build writes at most SUANLI_BUILD_MAX_BYTES (watched while it runs); an
image is counted at its size on disk against the quota before it is pushed; the host keeps
no copy of what a build made or pulled once it ends, and a deleted image goes from every
engine. Its log goes line by line to Redis and to the build's Channels group (the build
page's websocket), and its end is kept on the row.

A build's end (built, failed, or its worker gone) is told to its owner once, as
`build.finished`, in the transaction that records it.

Layer: images (beside access and runs); uses engine_build, nodes (registry, engine,
workspaces), files (storage), events (webhooks), models and base (queue, logstore, text,
validators).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import re
import stat
import tarfile
import tempfile
import threading
import time
import unicodedata
from dataclasses import dataclass
from datetime import timedelta

import docker
import redis
import requests
import urllib3
from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import Count, Q
from django.utils import timezone
from django.utils.translation import gettext as _
from django.utils.translation import gettext_noop, ngettext

from jobs.base import logstore, validators
from jobs.base.queue import enqueue_by_name
from jobs.base.text import Text, fit
from jobs.events import webhooks
from jobs.files import storage
from jobs.images import engine_build
from jobs.models import Cluster, Host, Image, ImageBuild, Node, OwnImage
from jobs.nodes import engine, registry, workspaces

log = logging.getLogger(__name__)

DOCKERFILE_MAX = 64 * 1024
BUILD_ARGS_MAX = 50
_DOCKERFILE_NAME = ".suanli.Dockerfile"  # ours, beside whatever the context holds
_ARG_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
_STEP = re.compile(r"^Step (\d+)/(\d+) : (.*)$")
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")  # the engine colours a step's stderr
_LOG_KEEP_S = 3600
_LINE_MAX = 2000  # characters of one log line
_REDIS_LINES = 1000  # the last lines kept in Redis for the page (at most ~2 MB)
_STREAM_MAX = 8_000_000  # bytes of a build's log sent live; past it only its end is kept  # a finished build's lines stay in Redis this long (the row keeps its end)


def enabled() -> bool:
    return registry.enabled()


def group_for(build_id: int) -> str:
    return f"image-build-{int(build_id)}"


@dataclass(frozen=True)
class Quota:
    count: int
    max_count: int
    bytes: int
    max_bytes: int

    @property
    def full(self) -> bool:
        return self.count >= self.max_count or self.bytes >= self.max_bytes


def quota(owner, *, adding: list | None = None, replacing: tuple[str, str] | None = None) -> Quota:
    """A researcher's images and the bytes of their distinct layers (a layer two of them
    share is counted once), each at its size on a host's disk, uncompressed (an image
    pushed before sizes were counted so: its layers as the registry stores them). With
    `adding` ([[layer, bytes], ...] of an image not yet kept) in place of the image
    named `replacing` ((name, tag)), what the quota would be with it. The bytes count the
    researcher's saved system disks too (workspaces.saves_layers: a stopped cluster's
    root filesystems in the registry), which are no images."""
    rows = OwnImage.objects.filter(owner=owner)
    if replacing is not None:
        rows = rows.exclude(name=replacing[0], tag=replacing[1])
    images = list(rows.values_list("layers", flat=True))
    if adding is not None:
        images.append(adding)
    return Quota(
        count=len(images),
        max_count=settings.SUANLI_IMAGE_QUOTA_COUNT,
        bytes=registry.distinct_bytes(
            images + workspaces.saves_layers(getattr(owner, "pk", owner))
        ),
        max_bytes=int(settings.SUANLI_IMAGE_QUOTA_GB * 1e9),
    )


real_layers = registry.real_layers  # [[layer, bytes], ...] of an image on an engine


def clusters_using(image: OwnImage):
    """The clusters that are not released and run (or keep, stopped) this image."""
    return Cluster.objects.filter(
        Q(own_image=image) | Q(image_reference=image.reference), owner_id=image.owner_id
    ).exclude(state__in=[Cluster.State.RELEASED, Cluster.State.FAILED])


# -- what FROM may name -----------------------------------------------------------------


_DIRECTIVE = re.compile(r"^[ \t]*#[ \t]*(syntax|escape|check)[ \t]*=", re.IGNORECASE)


def _check_text(dockerfile: str) -> None:
    """What the check cannot read as the engine does is refused: the engine's parser (not
    this one) decides which instructions there are, so every way to make them disagree
    goes (a parser directive such as `# escape=`, whitespace other than spaces, tabs and
    newlines, control characters), and ONBUILD (a trigger run by a later build, unchecked)."""
    for number, raw in enumerate(dockerfile.split("\n"), 1):
        for ch in raw:
            if ch != "\t" and (unicodedata.category(ch)[0] == "C" or (ch.isspace() and ch != " ")):
                raise ValidationError(
                    _(
                        "Line %(number)s contains the character %(char)s: use plain spaces, tabs "
                        "and line ends only."
                    )
                    % {"number": number, "char": f"U+{ord(ch):04X}"}
                )
        if _DIRECTIVE.match(raw):
            raise ValidationError(
                _(
                    "Line %(number)s: parser directives (# syntax=, # escape=) are not supported "
                    "here."
                )
                % {"number": number}
            )
    _check_fetches(dockerfile)
    for word, _rest in _instructions(dockerfile):
        if word == "ONBUILD":
            raise ValidationError(_("ONBUILD is not supported: its trigger would run unchecked."))


_CONTINUED = re.compile(r"\\[ \t]*$")


def _instructions(dockerfile: str):
    """(INSTRUCTION, arguments) of each instruction, as the engine's parser (moby/buildkit
    frontend/dockerfile/parser, which the classic builder uses too) reads them once
    `_check_text` holds: lines end at \\n only; a first line loses its leading spaces and
    tabs, a comment line is skipped; a line continues when it ends with a backslash (and
    spaces or tabs), which goes, and the next line is joined to it as it is, with no space
    added and its own leading spaces kept (`FROM img:ta\\` + `g2` is `FROM img:tag2`);
    comment and blank lines inside a continued instruction are skipped; the instruction
    word ends at the first space or tab."""
    lines = iter(dockerfile.split("\n"))
    for raw in lines:
        first = raw.lstrip(" \t")
        if first.startswith("#"):
            continue
        line, more = _continued(first)
        if not more and not line:
            continue
        for raw in lines if more else ():
            if raw.lstrip(" \t").startswith("#") or not raw.strip(" \t"):
                continue
            part, more = _continued(raw)
            line += part
            if not more:
                break
        if line.strip(" \t"):
            yield _word_and_rest(line)


def _continued(line: str) -> tuple[str, bool]:
    """The line without its continuation backslash, and whether it had one."""
    found = _CONTINUED.search(line)
    return (line[: found.start()], True) if found else (line, False)


def _word_and_rest(line: str) -> tuple[str, str]:
    parts = re.split(r"[ \t]+", line.strip(" \t"), maxsplit=1)
    return parts[0].upper(), (parts[1] if len(parts) > 1 else "").strip(" \t")


# -- what ADD may fetch ------------------------------------------------------------------

# The classic builder downloads `ADD <url>` itself, inside dockerd: in the host's network
# namespace, outside the firewalled build network, so it reaches the host's loopback and
# the private networks (the console, the registry, the engines' API). Nothing a build adds
# is fetched by the engine; a RUN step downloads instead (it runs on the build network).
_SCHEME = re.compile(r"://")
_GIT_REMOTE = re.compile(r"^(?:git@|github\.com/|[\w.~-]+@[\w.-]+:)", re.IGNORECASE)
_HOW_TO_DOWNLOAD = gettext_noop(
    "Download it in a RUN step instead, e.g. RUN curl -fsSLo /got.txt https://example.com/"
    "file (or wget -O): RUN steps run on the build network, which reaches the internet and "
    "nothing else."
)


def _check_fetches(dockerfile: str) -> None:
    """ADD names files of the build's context only: never a URL (any scheme, any case, in
    the JSON form, behind flags, split over lines), a git remote, or a variable (a build
    argument or ENV may expand to a URL when the engine runs the step), ONBUILD ADD too.
    The words are read as the engine reads them: its flags (`--chown=...`), then a JSON
    array or words split at spaces and tabs, each word with its quotes and backslashes
    taken away as the engine's word expansion does."""
    for word, rest in _instructions(dockerfile):
        if word == "ONBUILD":
            word, rest = _word_and_rest(rest)
        if word == "ADD":
            _check_add(rest)


def _check_add(rest: str) -> None:
    flags, rest = _builder_flags(rest)
    words = _add_words(rest)
    for text in [*flags, *words, rest]:
        plain = re.sub(r"[\"'\\]", "", text)
        if _SCHEME.search(plain) or _GIT_REMOTE.match(plain):
            raise ValidationError(
                _(
                    "ADD %(source)s: builds here do not fetch URLs or git remotes (the engine "
                    "would download them outside the build's network)."
                )
                % {"source": text[:200]}
                + " "
                + _(_HOW_TO_DOWNLOAD)
            )
    for text in words[:-1]:
        if "$" in text:
            raise ValidationError(
                _(
                    "ADD %(source)s: name the file of the build's context itself, not a variable "
                    "(a build argument could name a URL, which builds here do not fetch)."
                )
                % {"source": text[:200]}
                + " "
                + _(_HOW_TO_DOWNLOAD)
            )


def _add_words(rest: str) -> list[str]:
    """ADD's sources and destination as the engine reads them: the whole text as a JSON
    array of strings when it is exactly one (nothing after it), else the words between
    spaces and tabs (the engine falls back to those when its JSON parse fails, so
    `["x"] http:${E}//host/` is two sources, the second a URL once ${E} is empty)."""
    if rest.startswith("["):
        try:
            value = json.loads(rest)
        except ValueError:
            value = None
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return value
    return [w for w in re.split(r"[ \t]+", rest) if w]


def _builder_flags(rest: str) -> tuple[list[str], str]:
    """The leading `--name=value` words of an instruction and the text after them, as the
    engine's extractBuilderFlags reads them: a flag word may hold quotes (with spaces inside)
    and backslash escapes; a lone `--` ends the flags."""
    flags: list[str] = []
    pos, n = 0, len(rest)
    while True:
        while pos < n and rest[pos] in " \t":
            pos += 1
        if not rest.startswith("--", pos):
            return flags, rest[pos:]
        word, quote = "", ""
        while pos < n and (quote or rest[pos] not in " \t"):
            ch = rest[pos]
            if ch == "\\" and pos + 1 < n:
                pos += 1
                word += rest[pos]
            elif quote and ch == quote:
                quote = ""
            elif not quote and ch in "'\"":
                quote = ch
            elif ch != "\\":
                word += ch
            pos += 1
        if word == "--":
            return flags, rest[pos:].lstrip(" \t")
        flags.append(word)


def _normal(ref: str) -> str:
    repo = validators.image_repository(ref)
    name, _, digest = ref.strip().partition("@")
    if digest:
        return f"{repo}@{digest}"
    last = name.rpartition("/")[2]
    return f"{repo}:{last.partition(':')[2] or 'latest'}"


def _allowed(owner_id: int, ref: str) -> bool:
    normal = _normal(ref)
    catalog = Image.objects.filter(active=True).values_list("reference", flat=True)
    if normal in {_normal(r) for r in catalog}:
        return True
    if registry.in_registry(ref):
        own = OwnImage.objects.filter(owner_id=owner_id).values_list("reference", flat=True)
        return normal in {_normal(r) for r in own}
    for pattern in settings.SUANLI_BUILD_FROM_ALLOWED:
        if pattern.endswith("*"):
            if normal.startswith(_normal(pattern[:-1] + "x").rsplit("x", 1)[0]):
                return True
        elif normal == _normal(pattern):
            return True
    return False


def bases(dockerfile: str) -> list[str]:
    """The images a Dockerfile builds from (FROM, COPY/ADD --from, RUN --mount from=),
    without its own stages. ValidationError when one cannot be known before the build."""
    stages: set[str] = set()
    found: list[str] = []
    stage_count = 0
    for word, rest in _instructions(dockerfile):
        if word == "FROM":
            args = [a for a in re.split(r"[ \t]+", rest) if a and not a.startswith("--")]
            if not args:
                raise ValidationError(_("A FROM line names no image."))
            ref = args[0]
            if "$" in ref:
                raise ValidationError(
                    _(
                        "FROM %(image)s: write the image itself, not a build argument, so that it "
                        "can be checked before the build."
                    )
                    % {"image": ref}
                )
            if ref.lower() != "scratch" and ref.lower() not in stages:
                found.append(ref)
            if len(args) >= 3 and args[1].lower() == "as":
                stages.add(args[2].lower())
            stage_count += 1
        elif word in ("COPY", "ADD", "RUN"):
            for flag in re.findall(r"--(?:from|mount)=(\S+)", rest, re.IGNORECASE):
                source = flag
                if word == "RUN":
                    got = re.search(r"(?:^|,)from=([^,]+)", flag, re.IGNORECASE)
                    if not got:
                        continue
                    source = got.group(1)
                if "$" in source:
                    raise ValidationError(
                        _(
                            "%(instruction)s --from=%(source)s: name the stage or image itself, "
                            "not a build argument."
                        )
                        % {"instruction": word, "source": source}
                    )
                if source.lower() in stages or (
                    source.isdecimal() and len(source) < 6 and int(source) < stage_count
                ):
                    continue
                found.append(source)
    if stage_count == 0:
        raise ValidationError(_("A Dockerfile starts with FROM and the image to build on."))
    return found


def check_bases(owner_id: int, dockerfile: str) -> list[str]:
    _check_text(dockerfile)
    refs = bases(dockerfile)
    catalog = {
        _normal(r) for r in Image.objects.filter(active=True).values_list("reference", flat=True)
    }
    not_pulled = list(Image.objects.filter(pullable=False).values_list("reference", flat=True))
    for ref in refs:
        if not registry.in_registry(ref):  # the registry's own: _allowed checks the owner
            try:
                validators.validate_image_reference(ref)
                if _normal(ref) not in catalog:
                    # Suanli's own names (suanli/..., a catalog image never pulled) are the
                    # catalog's exact images or nothing: another tag would be Docker Hub's.
                    validators.validate_custom_image_reference(ref, not_pulled=not_pulled)
            except ValidationError as exc:
                raise ValidationError(
                    _("FROM %(image)s: %(error)s") % {"image": ref, "error": exc.messages[0]}
                ) from None
        if not _allowed(owner_id, ref):
            if settings.SUANLI_BUILD_FROM_ALLOWED:
                raise ValidationError(
                    _(
                        "FROM %(image)s: builds start from a catalog image, one of your own "
                        "images or %(allowed)s; %(image)s is none of them."
                    )
                    % {"image": ref, "allowed": ", ".join(settings.SUANLI_BUILD_FROM_ALLOWED)}
                )
            raise ValidationError(
                _(
                    "FROM %(image)s: builds start from a catalog image, one of your own images; "
                    "%(image)s is none of them."
                )
                % {"image": ref}
            )
    return refs


# -- creating builds --------------------------------------------------------------------


def _no_registry() -> ValidationError:
    return ValidationError(
        _(
            "Own images need an image registry, which the operator has not configured "
            "(SUANLI_REGISTRY)."
        )
    )


def _check_name(name: str, tag: str) -> dict:
    errors = {}
    for field, value, check in (
        ("name", name, validators.validate_own_image_name),
        ("tag", tag, validators.validate_own_image_tag),
    ):
        try:
            check(value)
        except ValidationError as exc:
            errors[field] = exc.messages
    return errors


def _check_quota(owner, name: str, tag: str) -> None:
    used = quota(owner)
    replacing = OwnImage.objects.filter(owner=owner, name=name, tag=tag).exists()
    if used.count >= used.max_count and not replacing:
        raise ValidationError(
            _(
                "You have %(count)s images, your quota: delete one (or push to an existing name "
                "and tag) first."
            )
            % {"count": used.count}
        )
    if used.bytes >= used.max_bytes:
        raise ValidationError(
            _("Your images take %(used)s of your %(quota)s: delete some first.")
            % {"used": registry.human(used.bytes), "quota": registry.human(used.max_bytes)}
        )


def check_build_args(build_args) -> dict[str, str]:
    """The build arguments as the engine gets them. A name the engine reads itself is
    refused: BUILDKIT_SYNTAX names a frontend image BuildKit would pull, and the other
    BUILDKIT_* change how the engine builds, not what the Dockerfile sees."""
    args: dict[str, str] = {}
    for key, value in dict(build_args or {}).items():
        if not _ARG_NAME.match(str(key)) or not isinstance(value, str) or "\x00" in value:
            raise ValidationError(
                _(
                    "Build argument %(name)s: a name of letters, digits and underscores and a "
                    "text value."
                )
                % {"name": repr(str(key)[:40])}
            )
        if str(key).upper().startswith("BUILDKIT_"):
            raise ValidationError(
                _(
                    "Build argument %(name)s: names starting with BUILDKIT_ set the build "
                    "engine itself (one names an image it would fetch); pick another name."
                )
                % {"name": str(key)}
            )
        args[str(key)] = value
    if len(args) > BUILD_ARGS_MAX:
        raise ValidationError(_("At most %(most)s build arguments.") % {"most": BUILD_ARGS_MAX})
    return args


def build_create(
    *, owner, name: str, tag: str, dockerfile: str, context: str = "", build_args=None
) -> ImageBuild:
    """Checks a build request and queues it. ValidationError by field."""
    if not enabled():
        raise _no_registry()
    name, tag = (name or "").strip(), (tag or "").strip() or "latest"
    errors = _check_name(name, tag)
    dockerfile = (dockerfile or "").replace("\r\n", "\n")  # a browser's textarea sends CRLF
    if not dockerfile.strip():
        errors["dockerfile"] = [_("Write the Dockerfile to build.")]
    elif len(dockerfile.encode()) > DOCKERFILE_MAX:
        errors["dockerfile"] = [
            _("A Dockerfile of at most %(kb)s KB, please.") % {"kb": DOCKERFILE_MAX // 1024}
        ]
    elif "\x00" in dockerfile:
        errors["dockerfile"] = [_("The Dockerfile contains a NUL character.")]
    else:
        try:
            check_bases(owner.pk, dockerfile)
        except ValidationError as exc:
            errors["dockerfile"] = exc.messages
    context = (context or "").strip().rstrip("/")
    if context:
        try:
            context = storage.folder_name(context)
            _context_dir(owner.pk, context)
        except ValidationError as exc:
            errors["context"] = exc.messages
    args = {}
    try:
        args = check_build_args(build_args)
    except ValidationError as exc:
        errors["build_args"] = exc.messages
    if not errors:
        try:
            _check_quota(owner, name, tag)
        except ValidationError as exc:
            errors["__all__"] = exc.messages
    if errors:
        raise ValidationError(errors)
    return _create(
        owner,
        kind=ImageBuild.Kind.BUILD,
        name=name,
        tag=tag,
        dockerfile=dockerfile,
        context=context,
        build_args=args,
    )


def save_create(*, owner, cluster: Cluster, node_index: int, name: str, tag: str) -> ImageBuild:
    """Queues the save of a node's workspace (its cluster running or stopped) as an image."""
    if not enabled():
        raise _no_registry()
    name, tag = (name or "").strip(), (tag or "").strip() or "latest"
    errors = _check_name(name, tag)
    if errors:
        raise ValidationError(errors)
    if cluster.owner_id != owner.pk:
        raise ValidationError(_("No such cluster."))
    if cluster.state not in (Cluster.State.RUNNING, Cluster.State.STOPPED) or not cluster.workspace:
        raise ValidationError(
            _("A workspace is saved from a running or stopped cluster with workspaces.")
        )
    if _node(cluster, node_index) is None:
        raise ValidationError(_("Node %(index)s has no workspace to save.") % {"index": node_index})
    if ImageBuild.objects.filter(
        cluster=cluster, node_index=node_index, state__in=ImageBuild.ACTIVE
    ).exists():
        raise ValidationError(
            _("Node %(index)s's workspace is being saved already.") % {"index": node_index}
        )
    _check_quota(owner, name, tag)
    return _create(
        owner,
        kind=ImageBuild.Kind.SAVE,
        name=name,
        tag=tag,
        cluster=cluster,
        node_index=node_index,
    )


def _create(owner, **fields) -> ImageBuild:
    with transaction.atomic():
        _check_active(owner)
        build = ImageBuild.objects.create(owner=owner, **fields)
        _queue(build)
    return build


def _check_active(owner) -> None:
    """At most SUANLI_BUILDS_PER_RESEARCHER builds and saves queued or running per
    researcher (their row locked: two requests cannot both take the last place), so that
    no one fills the build hosts' queue for everyone else."""
    get_user_model().objects.select_for_update().filter(pk=owner.pk).first()
    active = ImageBuild.objects.filter(owner=owner, state__in=ImageBuild.ACTIVE).count()
    if active >= settings.SUANLI_BUILDS_PER_RESEARCHER:
        raise ValidationError(
            _(
                "You have %(active)s builds queued or running, the most at a time: wait for one "
                "to end."
            )
            % {"active": active}
        )


def _queue(build: ImageBuild) -> None:
    enqueue_by_name(
        "jobs.tasks.image_build_run",
        build.pk,
        job_id=f"image-build-{build.pk}",
        queue="builds",
        job_timeout=settings.SUANLI_BUILD_TIMEOUT_S + 2 * settings.SUANLI_IMAGE_PULL_S,
    )


def _node(cluster: Cluster, index: int) -> Node | None:
    """The node row whose workspace holds the node's files now: live, or kept (stopped)."""
    return (
        Node.objects.filter(cluster=cluster, index=index)
        .exclude(workspace_container="")
        .filter(Q(released_at__isnull=True) | Q(stopped_at__isnull=False, kept_until__isnull=True))
        .select_related("host")
        .order_by("-id")
        .first()
    )


def delete(*, owner, image: OwnImage) -> None:
    """Removes an image of the researcher's from the registry and the list; refused while a
    cluster that is not released uses it."""
    if image.owner_id != owner.pk:
        raise ValidationError(_("No such image."))
    using = list(clusters_using(image).values_list("name", flat=True)[:5])
    if using:
        raise ValidationError(
            ngettext(
                "%(image)s is used by cluster %(clusters)s: release it first.",
                "%(image)s is used by cluster %(clusters)s: release them first.",
                len(using),
            )
            % {"image": image, "clusters": ", ".join(using)}
        )
    repo, tag = registry.split(image.reference)
    shared = (
        OwnImage.objects.filter(owner=owner, name=image.name, digest=image.digest)
        .exclude(pk=image.pk)
        .exists()
    )
    if not shared:  # a manifest is deleted by digest: every tag on it goes with it
        try:
            registry.delete(repo, tag)
        except registry.RegistryError as exc:
            raise ValidationError(
                _("%(image)s could not be deleted: %(error)s") % {"image": image, "error": exc}
            ) from None
    reference = image.reference
    image.delete()
    # The engines' copies (the build host's, the hosts' that pulled it) go on the builds
    # queue: a slow or unreachable engine holds up no page.
    _queue_forget(reference)


def _queue_forget(reference: str, host_id: int | None = None) -> None:
    key = hashlib.sha256(f"{reference} {host_id}".encode()).hexdigest()[:32]
    enqueue_by_name(
        "jobs.tasks.image_forget_local",
        reference,
        host_id,
        job_id=f"image-forget-{key}",
        queue="builds",
    )


# -- the build log ----------------------------------------------------------------------


def _redis() -> redis.Redis:
    return logstore.connect()


def _log_key(build_id: int) -> str:
    return f"suanli:image-build:{int(build_id)}:log"


def log_lines(build: ImageBuild) -> list[tuple[int, str]]:
    """The build's lines so far, numbered from 1: from Redis while it runs (and an hour
    after), else from the row."""
    try:
        stored = logstore.read(_redis(), _log_key(build.pk))
    except redis.RedisError:
        stored = []
    if stored:
        return stored
    return [(i, line) for i, line in enumerate(build.log.splitlines(), 1)]


class _Log:
    """Lines to Redis (numbered) and to the build's group. A sender thread sends what was
    written at most 0.2 s later (a quiet step never holds a line back), in order: a state
    goes after the lines written before it."""

    def __init__(self, build: ImageBuild):
        self.build = build
        self.key = _log_key(build.pk)
        self.redis = _redis()
        self.redis.delete(self.key)
        self.seq = 0
        self.pending: list[list] = []
        self.outbox: list[dict] = []
        self.kept: list[str] = []
        self.kept_bytes = 0
        self.partial = ""
        self.streamed = 0
        self.cut_off = False
        self.layer = get_channel_layer()
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.closed = False
        self.sender = threading.Thread(
            target=self._send_loop, daemon=True, name=f"image-build-{build.pk}-log"
        )
        self.sender.start()

    def write(self, text: str) -> None:
        with self.lock:
            text = self.partial + _ANSI.sub("", text)
            *lines, self.partial = text.split("\n")
            for line in lines:
                self._append(line.rstrip("\r"))
            while len(self.partial) > _LINE_MAX:  # a line that never ends comes in pieces
                self._append(self.partial[:_LINE_MAX])
                self.partial = self.partial[_LINE_MAX:]

    def line(self, line: str) -> None:
        with self.lock:
            self._append(line)

    def _append(self, line: str) -> None:
        line = line[:_LINE_MAX]
        self.seq += 1
        self.streamed += len(line) + 1
        if self.streamed <= _STREAM_MAX:
            self.pending.append([self.seq, line])
        elif not self.cut_off:
            self.cut_off = True
            self.pending.append(
                [
                    self.seq,
                    f"(the log passed {_STREAM_MAX // 1_000_000} MB: the rest is not shown "
                    "live; its end is kept when the build ends)",
                ]
            )
        self.kept.append(line)
        self.kept_bytes += len(line) + 1
        while self.kept_bytes > settings.SUANLI_BUILD_LOG_BYTES and len(self.kept) > 1:
            self.kept_bytes -= len(self.kept.pop(0)) + 1

    def _cut(self) -> None:  # under the lock
        if self.pending:
            self.outbox.append({"type": "build.lines", "lines": self.pending})
            self.pending = []

    def state(self, **fields) -> None:
        for name, value in fields.items():
            setattr(self.build, name, value)
        ImageBuild.objects.filter(pk=self.build.pk).update(**fields)
        b = self.build
        message = {
            "type": "build.state",
            "state": b.state,
            "step": b.step,
            "done_bytes": b.done_bytes,
            "total_bytes": b.total_bytes,
            "error": b.error,
            "image": b.image.reference if b.image_id and b.image else "",
        }
        with self.lock:
            self._cut()
            self.outbox.append(message)
        if self.closed:
            self._drain()
        else:
            self.wake.set()

    def flush(self) -> None:
        self.wake.set()

    def _send_loop(self) -> None:
        while not self.closed:
            self.wake.wait(0.2)
            self.wake.clear()
            self._drain()

    def _drain(self) -> None:
        with self.lock:
            self._cut()
            batch, self.outbox = self.outbox, []
        for message in batch:
            if message["type"] == "build.lines":
                try:
                    logstore.push(
                        self.redis, self.key, message["lines"], keep=_REDIS_LINES,
                        ttl=settings.SUANLI_BUILD_TIMEOUT_S + _LOG_KEEP_S,
                    )  # fmt: skip
                except redis.RedisError as exc:
                    log.warning("build %s: log not kept in Redis: %s", self.build.pk, exc)
            self._send(message)

    def _send(self, message: dict) -> None:
        if self.layer is None:
            return
        try:
            async_to_sync(self.layer.group_send)(group_for(self.build.pk), message)
        except Exception as exc:  # Redis down: the page reads the row once it ends
            log.warning("build %s: not published: %s", self.build.pk, exc)

    def close(self) -> str:
        """Sends what is left (the sender thread ends first: one sender at a time)."""
        with self.lock:
            if self.partial:  # the last line, without its end
                self._append(self.partial.rstrip("\r"))
                self.partial = ""
        self.closed = True
        self.wake.set()
        self.sender.join(30)
        self._drain()
        try:
            self.redis.expire(self.key, _LOG_KEEP_S)
        except redis.RedisError:
            pass
        return "\n".join(self.kept)


# -- running a build --------------------------------------------------------------------


class BuildFailed(Exception):
    """Why a build or save ended without an image, in words."""


def run(build_id: int) -> str:
    """The task: one build or save, from start to a pushed image (or a reason)."""
    with transaction.atomic():
        build = (
            ImageBuild.objects.select_for_update(of=("self",))
            .select_related("owner", "cluster")
            .filter(pk=build_id)
            .first()
        )
        if build is None or build.state != ImageBuild.State.QUEUED:
            return "not queued"  # a second delivery of the task
        build.state = ImageBuild.State.RUNNING
        build.started_at = timezone.now()
        build.save(update_fields=["state", "started_at"])
    out = _Log(build)
    result = "failed"
    left: _Leftovers | None = None
    try:
        if build.kind == ImageBuild.Kind.SAVE:
            node = _node(build.cluster, build.node_index) if build.cluster else None
            if node is None:
                raise BuildFailed(f"node {build.node_index} has no workspace to save any more")
            out.state(host=node.host)
            left = _Leftovers(node.host)
            left.references.append(registry.reference(build.owner_id, build.name, build.tag))
            local = _save(build, node, out)
        else:
            host = _build_host()
            out.state(host=host)
            left = _Leftovers(host)
            local = _build(build, host, out, left)
        layers = _check_real_size(build, build.host, local, out)
        image = _push(build, build.host, local, out, layers)
        _tidy(left, out)
        _end(
            out, state=ImageBuild.State.SUCCEEDED, image=image, step="", finished_at=timezone.now()
        )
        result = image.reference
    except BuildFailed as exc:
        out.line(f"ERROR: {exc}")
        _tidy(left, out)
        _end(
            out,
            state=ImageBuild.State.FAILED,
            error=fit(ImageBuild, "error", exc),
            finished_at=timezone.now(),
        )
    except Exception as exc:
        log.exception("build %s", build.pk)
        out.line(f"ERROR: {exc}")
        _tidy(left, out)
        _end(
            out,
            state=ImageBuild.State.FAILED,
            error=fit(ImageBuild, "error", f"the build stopped on an error of the platform: {exc}"),
            finished_at=timezone.now(),
        )
    finally:
        ImageBuild.objects.filter(pk=build.pk).update(log=out.close())
    return result


def _end(out: _Log, **fields) -> None:
    """The build's end on its row and its page, and its owner's `build.finished` event in
    the same transaction: once (a build the stuck sweep ended meanwhile was told then)."""
    with transaction.atomic():
        was = (
            ImageBuild.objects.select_for_update()
            .filter(pk=out.build.pk)
            .values_list("state", flat=True)
            .first()
        )
        out.state(**fields)
        if was in ImageBuild.ACTIVE:
            tell_finished(out.build)


def tell_finished(build: ImageBuild) -> None:
    """`build.finished` to the build's owner: the image's reference, and why it failed."""
    url = webhooks.console_link("image_build", build.pk)
    image = f"{build.name}:{build.tag}"
    succeeded = build.state == ImageBuild.State.SUCCEEDED
    data = {
        "build": {
            "id": build.pk, "kind": build.kind, "state": build.state, "image": image,
            "reference": registry.reference(build.owner_id, build.name, build.tag),
            "error": "" if succeeded else build.error, "url": url,
        },
        "url": url,
    }  # fmt: skip
    if succeeded:
        summary = Text(
            gettext_noop("Image %(image)s is built and ready to use: %(url)s"), image=image, url=url
        )
    else:
        summary = Text(
            gettext_noop("The build of image %(image)s failed: %(reason)s: %(url)s"),
            image=image, reason=build.error, url=url,
        )  # fmt: skip
    webhooks.emit(owner_id=build.owner_id, event_type="build.finished", data=data, summary=summary)


def _tidy(left: _Leftovers | None, out: _Log) -> None:
    """Pushed, failed or cut off: the host keeps no copy (before the build's last state,
    so that its log ends with it)."""
    if left is None:
        return
    try:
        left.remove(out)
    except Exception:  # an engine gone meanwhile: the image stays, the build's end holds
        log.warning("build %s: leftovers stay on %s", out.build.pk, left.host, exc_info=True)


class _Leftovers:
    """What one build or save put on its host, removed when it ends, pushed or not: the
    image's tag, the step images the build committed (a failed build's, and an earlier
    stage's, are dangling), and the images it pulled that are not catalog images (one of
    the researcher's own images as a base or as the cache, an allowed base). The engine
    refuses to remove an image a container uses (a workspace on a build host), and removes
    a removed image's untagged parents with it."""

    def __init__(self, host: Host):
        self.host = host
        self.references: list[str] = []
        self.steps: list[str] = []  # image ids, oldest first

    def remove(self, out: _Log | None = None) -> None:
        try:
            client = engine.client_for(self.host, timeout=120)
        except docker.errors.DockerException as exc:
            log.warning("build leftovers on %s stay: %s", self.host, exc)
            return
        try:
            for ref in dict.fromkeys(self.references):
                _remove_image(client, ref)
            for image_id in reversed(self.steps):
                try:
                    attrs = client.api.inspect_image(image_id)
                except docker.errors.DockerException:
                    continue  # gone with the image above it
                # Made here by a build (no tag, never pulled): a base (tagged, or pulled
                # by its digest) stays.
                if not attrs.get("RepoTags") and not attrs.get("RepoDigests"):
                    _remove_image(client, image_id, patient=True)
        finally:
            client.close()
        if out is not None:
            out.line(f"Removed the build's local copies from {self.host.name}")


_STEP_GONE_S = 30  # a cut-off build's step container, killed, is removed by the engine


def _remove_image(client: docker.DockerClient, ref: str, *, patient: bool = False) -> bool:
    """The image (or the tag, when the image has others) off the engine; False when it was
    not there or is in use (the engine says which; logged). `patient`: a step image of a
    build just cut off is in use until the engine has removed the step's container."""
    deadline = time.monotonic() + (_STEP_GONE_S if patient else 0)
    while True:
        try:
            client.api.remove_image(ref, noprune=False)
            return True
        except docker.errors.ImageNotFound:
            return False
        except docker.errors.APIError as exc:
            if exc.status_code == 409 and time.monotonic() < deadline:
                time.sleep(0.5)
                continue
            log.warning("image %s stays on the engine: %s", ref, engine.describe(exc))
            return False


def forget_local(reference: str, host_id: int | None = None) -> int:
    """A deleted image off every engine that has it (the build hosts, the hosts that pulled
    it), or off one host; the task after a delete. How many engines had it."""
    removed = 0
    hosts = Host.objects.exclude(state=Host.State.DOWN)
    for host in hosts.filter(pk=host_id) if host_id is not None else hosts:
        try:
            client = engine.client_for(host, timeout=60)
        except docker.errors.DockerException as exc:
            log.warning("deleted image %s may stay on %s: %s", reference, host, exc)
            continue
        try:
            removed += _remove_image(client, reference)
        except docker.errors.DockerException as exc:
            log.warning("deleted image %s may stay on %s: %s", reference, host, exc)
        finally:
            client.close()
    return removed


def _build_host() -> Host:
    hosts = list(Host.objects.filter(build_host=True, state=Host.State.ACTIVE))
    if not hosts:
        raise BuildFailed(
            "no build host is up: an operator marks hosts as build hosts (Hosts in the admin)"
        )
    busy = dict(
        ImageBuild.objects.filter(state__in=ImageBuild.ACTIVE, host__in=hosts)
        .values_list("host")
        .annotate(n=Count("id"))
    )
    return min(hosts, key=lambda h: (busy.get(h.pk, 0), h.pk))


def _context_dir(owner_id: int, folder: str) -> None:
    """The folder is a real folder of the researcher's storage (not a link, not a file)."""
    root = storage.tenant_root(owner_id)
    try:
        found = os.lstat(root / folder)
    except OSError:
        raise ValidationError(
            _("There is no folder '%(folder)s' in your storage.") % {"folder": folder}
        ) from None
    if not stat.S_ISDIR(found.st_mode):
        raise ValidationError(
            _("'%(folder)s' in your storage is not a folder.") % {"folder": folder}
        )


def _context_tar(build: ImageBuild, deadline: float | None = None):
    """The build context: the storage folder (when named) and the Dockerfile, as a tar.
    The folder is walked without following a link (`storage.walk_nofollow`: a link goes in
    as a link: the researcher writes this folder from inside a container and could swap a
    name for a link at any moment); only folders, files and links; at most
    SUANLI_BUILD_CONTEXT_MB."""
    spool = io.BytesIO() if not build.context else _spooled()
    with tarfile.open(fileobj=spool, mode="w") as tar:
        if build.context:
            try:
                top = storage.open_folder_nofollow(
                    storage.tenant_root(build.owner_id), build.context
                )
            except OSError:
                raise BuildFailed(
                    f"the context folder '{build.context}' is not a folder of your storage"
                ) from None
            try:
                with contextlib.closing(storage.walk_nofollow(top)) as entries:
                    _add_context(tar, entries, build.context, deadline)
            except OSError as exc:
                raise BuildFailed(f"the context folder could not be read: {exc}") from None
        data = build.dockerfile.encode()
        info = tarfile.TarInfo(_DOCKERFILE_NAME)
        info.size = len(data)
        info.mtime = int(time.time())
        tar.addfile(info, io.BytesIO(data))
    spool.seek(0)
    return spool


def _add_context(tar, entries, context: str, deadline: float | None) -> None:
    """The walked entries into the tar: folders, links (as links) and regular files, each
    file opened at its folder's descriptor without following a link; past the size limit or
    the deadline the build fails."""
    limit = settings.SUANLI_BUILD_CONTEXT_MB * 1024 * 1024
    too_big = (
        f"the context folder '{context}' holds more than {settings.SUANLI_BUILD_CONTEXT_MB} MB"
    )
    total = 0
    for dir_fd, name, path, st in entries:
        if deadline is not None and time.monotonic() > deadline:
            raise BuildFailed(
                "stopped: the build ran over its time limit while its context was read"
            )
        total += 512
        if total > limit:
            raise BuildFailed(too_big)
        info = tarfile.TarInfo(path)
        info.mode = stat.S_IMODE(st.st_mode)
        info.mtime = int(st.st_mtime)
        if stat.S_ISDIR(st.st_mode):
            info.type = tarfile.DIRTYPE
            tar.addfile(info)
        elif stat.S_ISLNK(st.st_mode):
            info.type = tarfile.SYMTYPE
            info.linkname = os.readlink(name, dir_fd=dir_fd)
            tar.addfile(info)
        elif stat.S_ISREG(st.st_mode):
            # O_NONBLOCK: a FIFO swapped in since the stat opens at once (and is skipped)
            # instead of waiting for a writer.
            flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
            with os.fdopen(os.open(name, flags, dir_fd=dir_fd), "rb") as fh:
                real = os.fstat(fh.fileno())
                if not stat.S_ISREG(real.st_mode):
                    continue
                total += real.st_size + 512  # and its tar header
                if total > limit:
                    raise BuildFailed(too_big)
                info.size = real.st_size
                tar.addfile(info, _Exact(fh, real.st_size))


def _spooled():
    return tempfile.SpooledTemporaryFile(max_size=64 * 1024 * 1024)


class _Exact(io.RawIOBase):
    """A file read as exactly `size` bytes (padded or cut): one that changes while it is
    tarred never breaks the archive."""

    def __init__(self, fh, size: int):
        self.fh, self.left = fh, size

    def read(self, n=-1):
        if self.left <= 0:
            return b""
        n = self.left if n is None or n < 0 else min(n, self.left)
        data = self.fh.read(n)
        if len(data) < n:
            data += b"\0" * (n - len(data))
        self.left -= len(data)
        return data


def _ensure_build_network(client: docker.DockerClient) -> str:
    """The network a build's RUN steps run on: ours (the tenant firewall keeps it off the
    host and the private networks), or none. The engine's own networks (its default
    bridge, the host's, another container's) reach the host's services: never those."""
    name = settings.SUANLI_BUILD_NETWORK
    if name in ("none", "bridge", "host", "default") or name.startswith("container:"):
        return "none"
    if not client.networks.list(names=[name]):
        try:
            client.networks.create(
                name,
                driver="bridge",
                options={
                    # slc+: the tenant firewall (jobs/hosts/scripts/host-firewall.sh) keeps its
                    # containers off the host and the private networks.
                    "com.docker.network.bridge.name": name[:15],
                    "com.docker.network.bridge.enable_icc": "false",
                },
                labels={"suanli.build": "1"},
            )
        except docker.errors.APIError as exc:
            if exc.status_code != 409:
                raise
    return name


def _pull_bases(
    client: docker.DockerClient, build: ImageBuild, out: _Log, left: _Leftovers
) -> None:
    """Every base on the engine before the build starts, pulled here when it is not (the
    engine would pull a missing one itself, then run its ONBUILD triggers unchecked), and
    refused when it has triggers. A base pulled for this build that is not a catalog image
    goes again when the build ends."""
    catalog = {
        _normal(r) for r in Image.objects.filter(active=True).values_list("reference", flat=True)
    }
    for ref in bases(build.dockerfile):
        if not registry.has_current(client, ref) or (
            registry.in_registry(ref) and not _current_in_registry(client, ref)
        ):
            if registry.not_pulled(ref):  # put on the hosts by an operator, never pulled
                raise BuildFailed(f"{ref} is not on the build host and is never pulled")
            out.line(f"Pulling {ref}")
            try:
                registry.pull(client, ref)
            except registry.RegistryError as exc:
                raise BuildFailed(f"{ref} could not be pulled: {exc}") from None
            if _normal(ref) not in catalog:
                left.references.append(ref)
        try:
            triggers = (client.images.get(ref).attrs.get("Config") or {}).get("OnBuild")
        except docker.errors.ImageNotFound:
            raise BuildFailed(f"{ref} is not on the build host") from None
        if triggers:  # run by the engine when a build starts FROM it, unchecked
            raise BuildFailed(f"{ref} has ONBUILD triggers, which builds here do not run")


def _current_in_registry(client: docker.DockerClient, ref: str) -> bool:
    """The engine has the registry's image as the registry has it now (a tag pushed again
    is pulled again; a copy tagged on the engine by hand is not the registry's)."""
    try:
        digest, _man = registry.manifest(*registry.split(ref))
    except registry.RegistryError:
        return False
    return registry.has_current(client, ref, digest)


# The engine's build API, the parameters this module sets and no other: no `remote` (a
# context the engine would fetch from a URL), no `extrahosts`, no `platform`, no `pull`,
# `version` 1 (the classic builder: BuildKit would pull the frontend a `# syntax=` line
# or a BUILDKIT_SYNTAX argument names), `networkmode` the build network.
_BUILD_PARAMS = frozenset(
    {"t", "dockerfile", "rm", "forcerm", "pull", "networkmode", "memory", "memswap",
     "cpuperiod", "cpuquota", "buildargs", "cachefrom", "version"}
)  # fmt: skip


def _build(build: ImageBuild, host: Host, out: _Log, left: _Leftovers) -> str:
    """The image built on `host`, tagged with its registry reference; its log streamed,
    its disk use watched (`_Watch`). What it leaves on the host is noted in `left`.
    Long because its steps (bases, cache, context, the engine's stream, the watch) share
    one client, one deadline and the try/finally that ends the watch and closes the client."""
    check_bases(build.owner_id, build.dockerfile)  # again: the catalog may have changed
    try:
        build_args = check_build_args(build.build_args)
    except ValidationError as exc:
        raise BuildFailed(" ".join(exc.messages)) from None
    reference = registry.reference(build.owner_id, build.name, build.tag)
    left.references.append(reference)
    timeout = settings.SUANLI_BUILD_TIMEOUT_S
    limit = settings.SUANLI_BUILD_MAX_BYTES
    deadline = time.monotonic() + timeout  # from here: the context and the bases count too
    client = engine.client_for(host, timeout=timeout + 60)
    try:
        _pull_bases(client, build, out, left)
        cache = _cache_sources(client, build, out, left)
        context = _context_tar(build, deadline)
        network = _ensure_build_network(client)
        memory = settings.SUANLI_BUILD_MEMORY_MB * 1024 * 1024
        params = {
            "t": reference,
            "dockerfile": _DOCKERFILE_NAME,
            "rm": True,
            "forcerm": True,
            "pull": False,
            "version": "1",
            "networkmode": network,
            "memory": memory,
            "memswap": memory,  # no swap beyond the memory
            "cpuperiod": 100000,
            "cpuquota": max(1000, int(settings.SUANLI_BUILD_CPUS * 100000)),
            "buildargs": json.dumps(build_args),
            # The cache is the researcher's own: only their images (and the steps under
            # them) are reused. Without a list the engine would reuse any tenant's step
            # that matched, and a hit would tell one researcher what another built.
            "cachefrom": json.dumps(cache),
        }
        assert set(params) <= _BUILD_PARAMS, set(params) - _BUILD_PARAMS
        out.line(
            f"Building on {host.name} (limits: {settings.SUANLI_BUILD_CPUS:g} CPUs, "
            f"{settings.SUANLI_BUILD_MEMORY_MB} MB, {timeout} s, "
            f"{registry.human(limit)} written)"
        )
        try:
            started = engine_build.start_build(client.api, context, params, timeout=timeout + 60)
        except docker.errors.APIError as exc:
            raise BuildFailed(f"the engine refused the build: {engine.describe(exc)}") from None
        over = threading.Event()

        def cut_off():  # the engine cancels a build whose client went (and kills its step)
            over.set()
            started.cut_off()

        timer = threading.Timer(max(1.0, deadline - time.monotonic()), cut_off)
        timer.daemon = True
        timer.start()
        watch = _Watch(host, limit, cut_off, left)
        built = ""
        error = ""
        try:
            for chunk in started.messages():
                if "stream" in chunk:
                    text = chunk["stream"]
                    step = _STEP.match(text.strip())
                    if step:
                        out.state(step=fit(ImageBuild, "step", text.strip()))
                    watch.read(text)
                    out.write(text)
                elif "error" in chunk:
                    error = (chunk.get("errorDetail") or {}).get("message") or chunk["error"]
                elif "aux" in chunk:
                    built = (chunk["aux"] or {}).get("ID", "")
                elif "status" in chunk:
                    out.line(str(chunk["status"]))
        except (
            requests.RequestException,
            urllib3.exceptions.HTTPError,
            OSError,
            ValueError,
        ) as exc:
            if not over.is_set():
                raise BuildFailed(f"the engine broke off the build: {exc}") from None
        finally:
            timer.cancel()
            watch.stop()
            out.flush()
        try:  # the last step may have ended between two polls
            too_big = watch.over or (not over.is_set() and watch.measure() > limit)
        finally:
            watch.close()
        if watch.flooded:
            raise BuildFailed(
                f"stopped: the build's output named more than {_NAMED_MAX} step containers "
                "and images, more than its Dockerfile makes, so its disk use could no longer "
                "be measured"
            )
        if too_big:
            raise BuildFailed(
                f"stopped: the build wrote {registry.human(watch.written)}, more than its "
                f"limit of {registry.human(limit)} (SUANLI_BUILD_MAX_BYTES), at "
                f"{out.build.step or 'its start'}"
            )
        if over.is_set():
            raise BuildFailed(
                f"stopped: the build ran over its time limit of {timeout} s "
                f"(at {out.build.step or 'its start'})"
            )
        if error:
            where = out.build.step or "the build"
            raise BuildFailed(f"{where} failed: {error.strip()}")
        if not built:
            raise BuildFailed("the engine ended the build without an image")
        return reference
    finally:
        client.close()


_NAMED_MAX = 2 * 2000  # step images and containers one build's output may name
_RUNNING_IN = re.compile(r"^ ---> Running in ([0-9a-f]{12,64})$")
_STEP_IMAGE = re.compile(r"^ ---> ([0-9a-f]{12,64})$")


class _Watch:
    """A build's disk use while it runs, polled from the engine every
    SUANLI_BUILD_POLL_S: the layers its steps committed (each step image's size less its
    parent's, as the engine records them) and the writable layers of its step containers
    (their SizeRw). Past the limit the build is cut off, as on its time limit: the engine
    cancels the build and removes the step's container.

    The classic builder names both in the build's output (` ---> Running in <container>`,
    ` ---> <image>`), which also carries what the researcher's steps print: a step may
    print lines that look like the engine's. So what is read only ever adds: a container
    or an image named once is measured until the engine no longer has it, and nothing the
    output says (a step line, "Using cache") makes one count less. A line made up by a
    step can only name what its author knows (IDs are digests: another tenant's are not
    known) and at most makes its own build count more."""

    def __init__(self, host: Host, limit: int, cut_off, left: _Leftovers):
        self.host, self.limit, self.cut_off, self.left = host, limit, cut_off, left
        self.images: list[str] = []  # step images named, oldest first
        self.containers: list[str] = []  # step containers named
        self.written = 0
        self.over = False
        self.flooded = False
        self.own: dict[str, int] = {}  # image -> its own layer's bytes (fixed once committed)
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.client = engine.client_for(host, timeout=30)
        self.thread = threading.Thread(target=self._loop, daemon=True, name="build-watch")
        self.thread.start()

    def read(self, text: str) -> None:
        """A piece of the build's output: the containers and images it names."""
        for line in text.split("\n"):
            line = _ANSI.sub("", line).rstrip()
            with self.lock:
                if len(self.images) + len(self.containers) >= _NAMED_MAX:
                    # Made up by a step (the engine names two per instruction): what it
                    # names next could no longer be measured, so the build stops.
                    self.flooded = True
                    break
                if got := _RUNNING_IN.match(line):
                    if got.group(1) not in self.containers:
                        self.containers.append(got.group(1))
                elif got := _STEP_IMAGE.match(line):
                    if got.group(1) not in self.images:
                        self.images.append(got.group(1))
                        self.left.steps.append(got.group(1))  # removed at the end if untagged
        if self.flooded:
            self.cut_off()

    def measure(self) -> int:
        with self.lock:
            named_images, named_containers = list(self.images), list(self.containers)
        committed = sum(self._own_bytes(image) for image in named_images)
        running = 0
        for container in named_containers:
            try:
                running += engine_build.container_size_rw(self.client.api, container)
            except docker.errors.NotFound:
                with self.lock:  # committed and removed: its image is counted instead
                    if container in self.containers:
                        self.containers.remove(container)
                continue
        self.written = committed + running
        return self.written

    def _own_bytes(self, image: str) -> int:
        """What the image's own layer takes: its size less its parent's. An image without
        a parent here (pulled, imported: a base) was not written by a build."""
        if image not in self.own:
            try:
                attrs = self.client.api.inspect_image(image)
                parent = attrs.get("Parent") or ""
                size = int(attrs.get("Size") or 0)
                if parent:
                    size -= int(self.client.api.inspect_image(parent).get("Size") or 0)
                self.own[image] = max(0, size) if parent else 0
            except docker.errors.NotFound:
                with self.lock:  # named by a step's output, not the engine: not asked again
                    if image in self.images:
                        self.images.remove(image)
                    if image in self.left.steps:
                        self.left.steps.remove(image)
                return 0
            except docker.errors.DockerException:
                return 0
        return self.own[image]

    def _loop(self) -> None:
        while not self.done.wait(settings.SUANLI_BUILD_POLL_S):
            try:
                if self.measure() > self.limit:
                    self.over = True
                    self.cut_off()
                    return
            except Exception:  # the engine hiccuped: the next poll, or the end, measures
                log.warning("build disk use not measured on %s", self.host, exc_info=True)

    def stop(self) -> None:
        self.done.set()
        self.thread.join(30)

    def close(self) -> None:
        self.client.close()


def _cache_sources(
    client: docker.DockerClient, build: ImageBuild, out: _Log, left: _Leftovers
) -> list[str]:
    """The researcher's own images the engine may take cached steps from. The hosts keep
    no copies of pushed images, so the newest image of the same name is pulled for it
    (and goes again when the build ends); the others count where a host still has them."""
    own = list(OwnImage.objects.filter(owner_id=build.owner_id).order_by("-updated_at")[:50])
    same = [i for i in own if i.name == build.name]
    same.sort(key=lambda i: (i.tag != build.tag, -i.updated_at.timestamp()))
    if same and not registry.has_current(client, same[0].reference, same[0].digest):
        out.line(f"Pulling {same[0].reference} for its cached steps")
        try:
            registry.pull(client, same[0].reference)
            left.references.append(same[0].reference)
        except registry.RegistryError as exc:
            out.line(f"(not pulled, built without its cache: {exc})")
    # Never empty: an empty list means "the engine's whole cache".
    return [registry.reference(build.owner_id, build.name, build.tag)] + [i.reference for i in own]


_PLATFORM_KEYS = ("SUANLI_", "CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "NCCL_")


def _save(build: ImageBuild, node: Node, out: _Log) -> str:
    """The workspace's filesystem committed on its host as the image's registry reference
    (volumes are not in it: they are the researcher's storage)."""
    reference = registry.reference(build.owner_id, build.name, build.tag)
    repository, tag = reference.rsplit(":", 1)
    client = engine.client_for(node.host, timeout=settings.SUANLI_WORKSPACE_SAVE_S)
    try:
        out.state(step=f"Saving node {node.index}'s workspace on {node.host.name}")
        out.line(f"Saving the workspace of node {node.index} ({node.host.name})")
        try:
            client.api.commit(node.workspace_container, repository=repository, tag=tag)
        except docker.errors.NotFound:
            raise BuildFailed(f"node {node.index}'s workspace is gone from its host") from None
        except docker.errors.APIError as exc:
            raise BuildFailed(f"the workspace could not be saved: {engine.describe(exc)}") from None
        out.line("Saved")
        return reference
    finally:
        client.close()


def _original_config(build: ImageBuild, host: Host) -> dict | None:
    """The config of the image the cluster was made from, as its host has it."""
    cluster = build.cluster
    if cluster is None:
        return None
    client = engine.cached_client(host)
    try:
        return client.images.get(cluster.image_reference).attrs.get("Config") or {}
    except docker.errors.DockerException:
        return None


def _check_real_size(build: ImageBuild, host: Host, reference: str, out: _Log) -> list[list]:
    """Before the push: the image at its size on a host's disk (its layers uncompressed:
    a layer of zeros is tiny in the registry and whole on every host that pulls it) must
    fit the researcher's quota, with the image it replaces left out. Its layers, for the
    quota once pushed."""
    client = engine.client_for(host, timeout=120)
    try:
        try:
            layers = real_layers(client, reference)
        except docker.errors.DockerException as exc:
            raise BuildFailed(f"the image could not be measured: {engine.describe(exc)}") from None
    finally:
        client.close()
    size = sum(n for _, n in layers)
    used = quota(build.owner, adding=layers, replacing=(build.name, build.tag))
    out.line(f"The image takes {registry.human(size)} on a host's disk")
    if used.bytes > used.max_bytes or used.count > used.max_count:
        raise BuildFailed(
            f"the image takes {registry.human(size)} on a host's disk (its layers, "
            f"uncompressed); with it your images would take {registry.human(used.bytes)} of "
            f"your {registry.human(used.max_bytes)} quota, so it was not pushed: delete "
            "images you no longer need, or make this one smaller"
        )
    return layers


def _push(build: ImageBuild, host: Host, reference: str, out: _Log, layers: list) -> OwnImage:
    """Pushes the image to the registry with progress, then records it with its layers
    at their size on disk (`_check_real_size`). Long because the record must follow the
    push in one piece: the quota is checked on the stored image, which is taken back from
    the registry when over."""
    repository, tag = reference.rsplit(":", 1)
    client = engine.client_for(host, timeout=settings.SUANLI_IMAGE_PULL_S)
    out.state(state=ImageBuild.State.PUSHING, step=f"Pushing {reference}")
    out.line(f"Pushing {reference}")
    sizes: dict[str, int] = {}
    done: dict[str, int] = {}
    last = 0.0
    try:
        for event in client.api.push(
            repository, tag=tag, stream=True, decode=True, auth_config=registry.auth_config()
        ):
            if "error" in event:
                raise BuildFailed(f"the push failed: {str(event['error']).strip()}")
            layer, status = event.get("id", ""), event.get("status", "")
            detail = event.get("progressDetail") or {}
            if status == "Pushing" and detail.get("total"):
                sizes[layer] = int(detail["total"])
                done[layer] = min(int(detail.get("current") or 0), sizes[layer])
            elif status in ("Pushed", "Layer already exists", "Mounted from"):
                done[layer] = sizes.get(layer, 0)
                out.line(f"{layer}: {status}")
            if time.monotonic() - last >= 0.5:
                last = time.monotonic()
                out.state(done_bytes=sum(done.values()), total_bytes=sum(sizes.values()))
    except docker.errors.APIError as exc:
        raise BuildFailed(f"the push failed: {engine.describe(exc)}") from None
    finally:
        client.close()
    try:
        if build.kind == ImageBuild.Kind.SAVE:
            digest, man = _clean_saved_config(build, host, repository, tag)
        else:
            digest, man = registry.manifest(*registry.split(reference))
    except registry.RegistryError as exc:
        raise BuildFailed(str(exc)) from None
    stored = sum(n for _, n in registry.layers_of(man))
    size = sum(n for _, n in layers)
    out.state(done_bytes=stored, total_bytes=stored)
    out.line(
        f"Pushed {reference} ({registry.human(stored)} in the registry, "
        f"{registry.human(size)} on disk, {digest})"
    )
    now = timezone.now()
    note = (
        f"saved from {build.cluster.name if build.cluster else 'a cluster'} node {build.node_index}"
        if build.kind == ImageBuild.Kind.SAVE
        else f"built on {host.name}"
    )
    fields = {
        "reference": reference,
        "digest": digest,
        "size_bytes": size,
        "layers": layers,
        "source": OwnImage.Source.SAVE
        if build.kind == ImageBuild.Kind.SAVE
        else OwnImage.Source.BUILD,
        "source_note": fit(OwnImage, "source_note", note),
        "updated_at": now,
    }
    before = OwnImage.objects.filter(
        owner_id=build.owner_id, name=build.name, tag=build.tag
    ).first()
    image, _ = OwnImage.objects.update_or_create(
        owner_id=build.owner_id,
        name=build.name,
        tag=build.tag,
        defaults=fields,
        create_defaults={**fields, "created_at": now},
    )
    if before is not None and before.digest and before.digest != digest:
        _forget_manifest(build.owner_id, build.name, before.digest)
    used = quota(build.owner)
    if used.bytes > used.max_bytes or used.count > used.max_count:
        image.delete()
        try:
            registry.delete(*registry.split(reference))
        except registry.RegistryError as exc:
            log.warning("over-quota image %s not deleted: %s", reference, exc)
        raise BuildFailed(
            f"the image would take your images to {registry.human(used.bytes)} of your "
            f"{registry.human(used.max_bytes)} quota; it was not kept"
        )
    return image


def _forget_manifest(owner_id: int, name: str, digest: str) -> None:
    """A tag pushed again leaves its old manifest in the registry, reachable by digest and
    counted by no quota: deleted, unless another tag of the researcher's is on it."""
    if OwnImage.objects.filter(owner_id=owner_id, name=name, digest=digest).exists():
        return
    try:
        registry.delete(registry.repository(owner_id, name), digest)
    except registry.RegistryError as exc:
        log.warning("the replaced manifest %s of u%s/%s stays: %s", digest, owner_id, name, exc)


def _clean_saved_config(build: ImageBuild, host: Host, repository: str, tag: str):
    """A commit keeps the container's settings: the platform's environment (its cluster's
    GPUs, ids), its labels and its entrypoint. The saved image gets the original image's
    settings back (in the registry: the same layers under a new config), and the host's
    local copy, which still has them, is untagged (the host pulls the clean one)."""
    original = _original_config(build, host)

    def change(config: dict) -> None:
        cfg = config.setdefault("config", {})
        if original is not None:
            for key in (
                "Env",
                "Cmd",
                "Entrypoint",
                "WorkingDir",
                "User",
                "Labels",
                "ExposedPorts",
                "Volumes",
                "StopSignal",
                "Healthcheck",
                "Shell",
            ):
                if original.get(key) is None:
                    cfg.pop(key, None)
                else:
                    cfg[key] = original[key]
        else:
            cfg["Env"] = [e for e in cfg.get("Env") or [] if not e.startswith(_PLATFORM_KEYS)]
            cfg["Labels"] = {
                k: v for k, v in (cfg.get("Labels") or {}).items() if not k.startswith("suanli.")
            }
        config.pop("container_config", None)
        config.pop("container", None)

    result = registry.rewrite_config(registry.split(f"{repository}:{tag}")[0], tag, change)
    try:
        engine.cached_client(host).images.remove(f"{repository}:{tag}")
    except docker.errors.DockerException as exc:
        log.warning("saved image %s:%s not untagged on %s: %s", repository, tag, host, exc)
    return result


def sweep_stuck() -> int:
    """Builds whose worker died (past every limit and still running) end as failed; the
    tag the build may have left on its host goes (its step images cannot be known any
    more: the worker kept them)."""
    limit = settings.SUANLI_BUILD_TIMEOUT_S + 2 * settings.SUANLI_IMAGE_PULL_S + 600
    cutoff = timezone.now() - timedelta(seconds=limit)
    stuck = ImageBuild.objects.filter(
        state__in=[ImageBuild.State.RUNNING, ImageBuild.State.PUSHING], started_at__lt=cutoff
    )
    leftovers = {
        (registry.reference(b.owner_id, b.name, b.tag), b.host_id) for b in stuck if b.host_id
    }
    swept = 0
    for build in stuck:
        with transaction.atomic():  # each ended once, with its event (the update is the guard)
            fields = {
                "state": ImageBuild.State.FAILED,
                "error": "the build's worker stopped before it ended; build again",
                "finished_at": timezone.now(),
            }
            if not ImageBuild.objects.filter(
                pk=build.pk, state__in=[ImageBuild.State.RUNNING, ImageBuild.State.PUSHING]
            ).update(**fields):
                continue
            for name, value in fields.items():
                setattr(build, name, value)
            tell_finished(build)
            swept += 1
    for reference, host_id in sorted(leftovers) if registry.enabled() else ():
        _queue_forget(reference, host_id)
    return swept
