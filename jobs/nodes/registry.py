"""The registry researchers' own images live in (SUANLI_REGISTRY): names in it, its HTTP API
for what an engine does not do (sizes, deletes, an image's config rewritten), and pulls of
its images onto hosts with the console's credentials and with progress.

Researchers never hold registry credentials: the console does, and hands them to an engine
for one pull or push (the engine keeps none). An image of researcher N is
`<registry>/u<N>/<name>:<tag>`; jobs/base/validators.py refuses those names to anyone but the
console's own choice of the owner's images.

Layer: nodes, over engine (workspaces and the builds pull through it); uses engine, events (the
timeline's writer), models and base (validators, text).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
from collections.abc import Callable

import docker
import requests
from django.conf import settings
from django.db import transaction
from django.utils import timezone
from django.utils.translation import gettext as _
from django.utils.translation import gettext_noop

from jobs.base.text import Text
from jobs.base.validators import image_repository, registry_refusal
from jobs.events import timeline
from jobs.models import Cluster, Image
from jobs.nodes import engine

log = logging.getLogger(__name__)

MANIFEST_TYPES = (
    "application/vnd.docker.distribution.manifest.v2+json",
    "application/vnd.oci.image.manifest.v1+json",
)
_TIMEOUT = 30


class RegistryError(Exception):
    """The registry refused or could not be reached; the message is for people (in the
    language active where it was raised: English in the workers). `status`: the registry's
    HTTP status when it answered with an error."""

    def __init__(self, message: str, *, status: int | None = None):
        super().__init__(message)
        self.status = status


def enabled() -> bool:
    return bool(settings.SUANLI_REGISTRY)


def host() -> str:
    """SUANLI_REGISTRY as references start: `host[:port]`, or `host[:port]/project` (a
    Harbor project, a cloud registry's namespace) under which the researchers' go."""
    return settings.SUANLI_REGISTRY.strip().strip("/").lower()


def server() -> str:
    return host().partition("/")[0]


def namespace(owner_id: int) -> str:
    return f"u{int(owner_id)}"


def repository(owner_id: int, name: str) -> str:
    """The repository path inside the registry (no server): `u5/my-torch`, or
    `project/u5/my-torch` under a project."""
    project = host().partition("/")[2]
    return f"{project + '/' if project else ''}{namespace(owner_id)}/{name}"


def reference(owner_id: int, name: str, tag: str) -> str:
    return f"{server()}/{repository(owner_id, name)}:{tag}"


def in_registry(ref: str) -> bool:
    """The reference names an image of our registry (any namespace)."""
    return enabled() and image_repository(ref).startswith(host() + "/")


def split(ref: str) -> tuple[str, str]:
    """(repository path inside the registry, tag) of one of its references."""
    name, _, digest = ref.partition("@")
    head, _, last = name.rpartition("/")
    last, _, tag = last.partition(":")
    path = f"{head}/{last}"[len(server()) + 1 :] if head else last
    return path, digest or tag or "latest"


def auth_config() -> dict:
    """Credentials for one engine call (pull, push): the engine stores none of them."""
    return {
        "username": settings.SUANLI_REGISTRY_USERNAME,
        "password": settings.SUANLI_REGISTRY_PASSWORD,
        "serveraddress": server(),
    }


def auth_for(ref: str) -> dict | None:
    return auth_config() if in_registry(ref) and settings.SUANLI_REGISTRY_USERNAME else None


# -- the registry's HTTP API (distribution spec v2) -------------------------------------


class _Api:
    """Basic auth (docker-registry's htpasswd) or the token flow (Harbor, cloud registries):
    on a 401 the challenge says which; a token is kept per scope until it is refused."""

    def __init__(self):
        self.session = requests.Session()
        # Per request: a session's own `verify` loses to REQUESTS_CA_BUNDLE in the environment.
        self.verify = settings.SUANLI_REGISTRY_CA or True
        self.credentials = (settings.SUANLI_REGISTRY_USERNAME, settings.SUANLI_REGISTRY_PASSWORD)
        self.tokens: dict[str, str] = {}

    def close(self):
        self.session.close()

    def request(self, method: str, path: str, *, scope: str, **kwargs) -> requests.Response:
        url = path if path.startswith("https://") else f"https://{server()}/v2/{path}"
        kwargs.setdefault("timeout", _TIMEOUT)
        kwargs["verify"] = self.verify
        headers = dict(kwargs.pop("headers", {}) or {})
        for attempt in range(2):
            if scope in self.tokens:
                headers["Authorization"] = self.tokens[scope]
            try:
                response = self.session.request(method, url, headers=headers, **kwargs)
            except requests.RequestException as exc:
                raise RegistryError(
                    _("the image registry %(registry)s did not answer: %(error)s")
                    % {"registry": host(), "error": exc}
                ) from exc
            if response.status_code != 401 or attempt:
                return response
            self.tokens[scope] = self._authorization(response, scope)
        return response

    def _authorization(self, response: requests.Response, scope: str) -> str:
        challenge = response.headers.get("WWW-Authenticate", "")
        scheme, _sep, rest = challenge.partition(" ")
        if scheme.lower() == "basic":
            return requests.auth._basic_auth_str(*self.credentials)
        if scheme.lower() != "bearer":
            raise RegistryError(_refused())
        params = dict(re.findall(r'(\w+)="([^"]*)"', rest))
        realm = params.pop("realm", "")
        if not realm.startswith("https://"):
            raise RegistryError(
                _("the image registry's token service is not HTTPS (%(realm)s)")
                % {"realm": repr(realm)}
            )
        params["scope"] = scope
        try:
            got = self.session.get(
                realm, params=params, auth=self.credentials, timeout=_TIMEOUT, verify=self.verify
            )
        except requests.RequestException as exc:
            raise RegistryError(
                _("the registry's token service did not answer: %(error)s") % {"error": exc}
            ) from exc
        if got.status_code != 200:
            raise RegistryError(_refused())
        body = got.json()
        return f"Bearer {body.get('token') or body.get('access_token')}"


def _refused() -> str:
    return _("the image registry %(registry)s refused the console's credentials") % {
        "registry": host()
    }


def _scope(repo: str, actions: str = "pull") -> str:
    return f"repository:{repo}:{actions}"


def _check(response: requests.Response, what: str) -> requests.Response:
    if response.status_code >= 400:
        try:
            errors = response.json().get("errors") or []
            detail = "; ".join(e.get("message", "") for e in errors) or response.reason
        except ValueError:
            detail = response.reason
        raise RegistryError(
            _("%(what)s: the registry answered %(status)s (%(detail)s)")
            % {"what": what, "status": response.status_code, "detail": detail},
            status=response.status_code,
        )
    return response


def manifest(repo: str, ref: str, *, api: _Api | None = None) -> tuple[str, dict]:
    """(digest, manifest) of `repo:ref` (a tag or a digest)."""
    own = api is None
    api = api or _Api()
    try:
        response = _check(
            api.request(
                "GET",
                f"{repo}/manifests/{ref}",
                scope=_scope(repo),
                headers={"Accept": ", ".join(MANIFEST_TYPES)},
            ),
            _("reading %(image)s") % {"image": f"{repo}:{ref}"},
        )
    finally:
        if own:
            api.close()
    digest = response.headers.get("Docker-Content-Digest") or (
        "sha256:" + hashlib.sha256(response.content).hexdigest()
    )
    return digest, response.json()


def layers_of(man: dict) -> list[list]:
    """[[digest, bytes], ...] of a manifest's config and layers (what the registry stores)."""
    blobs = [man.get("config") or {}, *(man.get("layers") or [])]
    return [[b["digest"], int(b.get("size") or 0)] for b in blobs if b.get("digest")]


def delete(repo: str, tag: str) -> bool:
    """Deletes the manifest `repo:tag` names (its blobs go at the registry's next garbage
    collection). False when it was not there."""
    api = _Api()
    try:
        try:
            digest, _man = manifest(repo, tag, api=api)
        except RegistryError as exc:
            if exc.status == 404:
                return False
            raise
        response = api.request("DELETE", f"{repo}/manifests/{digest}", scope=_scope(repo, "*"))
        if response.status_code == 404:
            return False
        _check(response, _("deleting %(image)s") % {"image": f"{repo}:{tag}"})
        return True
    finally:
        api.close()


def delete_manifest(repo: str, digest: str) -> bool:
    """Deletes the manifest `digest` of `repo` (and so every tag on it). False when it was
    not there."""
    api = _Api()
    try:
        response = api.request("DELETE", f"{repo}/manifests/{digest}", scope=_scope(repo, "*"))
        if response.status_code == 404:
            return False
        _check(response, _("deleting %(image)s") % {"image": f"{repo}@{digest}"})
        return True
    finally:
        api.close()


def digest_of(repo: str, tag: str) -> str | None:
    """The digest `repo:tag` names now, or None when the registry has no such tag."""
    try:
        return manifest(repo, tag)[0]
    except RegistryError as exc:
        if exc.status == 404:
            return None
        raise


def tags(repo: str) -> list[str]:
    """The tags of `repo` ([] when the registry has none, or no such repository)."""
    api = _Api()
    try:
        response = api.request("GET", f"{repo}/tags/list", scope=_scope(repo))
        if response.status_code == 404:
            return []
        return sorted(_check(response, _("listing %(repo)s") % {"repo": repo}).json()["tags"] or [])
    finally:
        api.close()


def rewrite_config(repo: str, tag: str, change: Callable[[dict], None]) -> tuple[str, dict]:
    """`repo:tag` again with its config changed by `change` (in place) and the same layers:
    a new config blob, then a new manifest under the tag. (digest, manifest) of the result.
    For a saved workspace, whose commit carried the container's own settings."""
    api = _Api()
    scope = _scope(repo, "pull,push")
    try:
        _digest, man = manifest(repo, tag, api=api)
        old = man["config"]
        config = _check(
            api.request("GET", f"{repo}/blobs/{old['digest']}", scope=scope),
            _("reading the config"),
        ).json()
        change(config)
        body = json.dumps(config, separators=(",", ":")).encode()
        digest = "sha256:" + hashlib.sha256(body).hexdigest()
        started = _check(
            api.request("POST", f"{repo}/blobs/uploads/", scope=scope), _("starting an upload")
        )
        location = started.headers["Location"]
        if location.startswith("/"):
            location = f"https://{server()}{location}"
        _check(
            api.request(
                "PUT",
                location,
                scope=scope,
                params={"digest": digest},
                data=body,
                headers={"Content-Type": "application/octet-stream"},
            ),
            _("uploading the config"),
        )
        man = dict(man, config=dict(old, digest=digest, size=len(body)))
        payload = json.dumps(man, separators=(",", ":")).encode()
        put = _check(
            api.request(
                "PUT",
                f"{repo}/manifests/{tag}",
                scope=scope,
                data=payload,
                headers={"Content-Type": man.get("mediaType") or MANIFEST_TYPES[0]},
            ),
            _("writing the manifest"),
        )
        return put.headers.get("Docker-Content-Digest") or (
            "sha256:" + hashlib.sha256(payload).hexdigest()
        ), man
    finally:
        api.close()


# -- pulls onto hosts -------------------------------------------------------------------


_UNITS = ("kB", "MB", "GB", "TB", "PB")


def human(value) -> str:
    """Bytes in decimal units, as Docker and registries count them: "340 MB", "1.2 GB"."""
    try:
        size = float(value or 0)
    except (TypeError, ValueError):
        return ""
    if size < 1000:
        return f"{int(size)} B"
    for unit in _UNITS:
        size /= 1000
        text = f"{size:.1f}" if size < 99.95 else f"{size:.0f}"
        if float(text) < 1000 or unit == _UNITS[-1]:  # 999.96 MB is 1 GB, not "1000 MB"
            return f"{text.removesuffix('.0')} {unit}"
    raise AssertionError("unreachable")


def pull(
    client: docker.DockerClient,
    ref: str,
    *,
    on_progress: Callable[[int, int], None] | None = None,
    every: float = 0.5,
) -> None:
    """Pulls `ref` onto the engine, with the console's credentials when it is one of our
    registry's; `on_progress(done, total)` (bytes to download, compressed) at most every
    `every` seconds and once at the end. Raises RegistryError with the engine's words."""
    sizes: dict[str, int] = {}
    total = 0
    if not in_registry(ref) and (why := registry_refusal(ref)):
        # A build's base too: the engine contacts no registry of ours to choose.
        raise RegistryError(why, status=403)
    if in_registry(ref):
        repo, tag = split(ref)
        _digest, man = manifest(repo, tag)
        # The engine names a layer by its digest's first 12 hex digits.
        sizes = {d.split(":", 1)[1][:12]: n for d, n in layers_of(man)[1:]}
        total = sum(sizes.values())
    name, _sep, digest = ref.partition("@")
    repo_name, tag = (name, digest) if digest else _repo_tag(name)
    done: dict[str, int] = {}
    last = 0.0
    try:
        stream = client.api.pull(
            repo_name, tag=tag, stream=True, decode=True, auth_config=auth_for(ref)
        )
        for event in stream:
            if "error" in event:
                raise RegistryError(str(event["error"]).strip())
            layer, status = event.get("id", ""), event.get("status", "")
            detail = event.get("progressDetail") or {}
            if status == "Downloading" and detail.get("total"):
                sizes.setdefault(layer, int(detail["total"]))
                if not total or layer not in sizes:
                    total = max(total, sum(sizes.values()))
                done[layer] = int(detail.get("current") or 0)
            elif status in ("Download complete", "Already exists", "Pull complete"):
                done[layer] = sizes.get(layer, done.get(layer, 0))
            if on_progress and time.monotonic() - last >= every:
                last = time.monotonic()
                on_progress(min(sum(done.values()), total or 0), total)
    except docker.errors.APIError as exc:
        raise RegistryError(engine.describe(exc)) from exc
    except requests.RequestException as exc:
        raise RegistryError(_("the pull broke off: %(error)s") % {"error": exc}) from exc
    if on_progress:
        on_progress(total, total)


def push(client: docker.DockerClient, ref: str) -> str:
    """Pushes `ref`, an image the engine has under a name of our registry, with the
    console's credentials (the engine keeps none); returns the digest the registry stored
    it under. Raises RegistryError with the engine's words."""
    if not in_registry(ref):
        raise RegistryError(_("%(image)s is not an image of Suanli's registry") % {"image": ref})
    repository, tag = ref.rsplit(":", 1)
    digest = ""
    try:
        for event in client.api.push(
            repository, tag=tag, stream=True, decode=True, auth_config=auth_for(ref)
        ):
            if "error" in event:
                raise RegistryError(str(event["error"]).strip())
            digest = (event.get("aux") or {}).get("Digest") or digest
    except docker.errors.APIError as exc:
        raise RegistryError(engine.describe(exc)) from exc
    except requests.RequestException as exc:
        raise RegistryError(_("the push broke off: %(error)s") % {"error": exc}) from exc
    return digest or manifest(*split(ref))[0]


def pull_public(
    client: docker.DockerClient,
    ref: str,
    *,
    host: str = "",
    cluster_id: int | None = None,
    db: Callable | None = None,
) -> None:
    """Pull `ref` (not one of our registry's: see `pull`) from the registry it names, only
    when that registry is public (validators.registry_refusal): a reference stored before
    that rule, or a name that resolves elsewhere since it was checked, never has the engine
    contact the hosts' own networks. Never a catalog image that is not pullable, nor one of
    Suanli's own namespace on Docker Hub (`suanli/`): those are put on hosts by an operator
    (built on the machine); whoever owns that name on Docker Hub is not us, and the pulled
    tag would pass for the catalog's on that host. RegistryError says why not. Its
    progress is kept on the cluster (`Cluster.image_pulls`: its page, and `stalled`, read
    it), as `ensure` keeps our registry's. `db(fn, *args)`: who runs its database work (a
    thread that makes engine calls only has its caller run them)."""
    db = db or _direct
    if db(not_pulled, ref):
        raise RegistryError(
            _(
                "%(image)s is not on host %(host)s and is never pulled: an operator puts it "
                "on hosts; pick another image or ask for it on this host."
            )
            % {"image": ref, "host": host or "?"},
            status=404,
        )  # final (`unavailable`)
    if why := registry_refusal(ref):
        raise RegistryError(why, status=403)  # refused before asking: final (`unavailable`)
    db(_pull_state, cluster_id, host, state="pulling", done=0, total=0)
    got = {"total": 0}

    def progress(done: int, total: int) -> None:
        got["total"] = total
        db(_pull_state, cluster_id, host, state="pulling", done=done, total=total)

    try:
        pull(client, ref, on_progress=progress)
    except RegistryError as exc:
        db(_pull_state, cluster_id, host, state="failed", message=str(exc))
        if isinstance(exc.__cause__, docker.errors.APIError | requests.RequestException):
            raise exc.__cause__ from None  # the engine's own error: callers tell its kind
        raise
    db(_pull_state, cluster_id, host, state="pulled", done=got["total"], total=got["total"])


def not_pulled(ref: str) -> bool:
    """Whether `ref` names a catalog image that is not pullable (`Image.pullable`), or any
    image of Suanli's own `suanli/` namespace on Docker Hub: hosts never pull those."""
    repository = image_repository(ref)
    if repository.startswith("docker.io/suanli/"):
        return True
    return any(
        image_repository(other) == repository
        for other in Image.objects.filter(pullable=False).values_list("reference", flat=True)
    )


# Words of an engine or a registry that says the image is not there, or not for us: a
# retry finds it no more than this try did. Lower case; matched in the error's text.
_IMAGE_GONE = (
    "pull access denied",
    "manifest unknown",
    "name unknown",
    "repository does not exist",
    "no such image",
    "not found: manifest",
    "manifest for",
    "invalid reference format",
    "requested access to the resource is denied",
)


def unavailable(exc: BaseException) -> bool:
    """Whether a pull (or a make from an image) failed for good: the image does not exist,
    we may not pull it (a registry that refuses it, or one our rules refuse), or its
    reference is not one; as opposed to an engine or a registry that did not answer this
    time (tried again). Its engine's or registry's words say which."""
    if isinstance(exc, docker.errors.ImageNotFound):
        return True
    for err in (exc, exc.__cause__):
        if isinstance(err, RegistryError) and err.status in (403, 404):
            return True
    text = engine.describe(exc).lower()
    return any(words in text for words in _IMAGE_GONE)


def _repo_tag(name: str) -> tuple[str, str]:
    head, _, last = name.rpartition("/")
    last, _, tag = last.partition(":")
    return (f"{head}/{last}" if head else last), tag or "latest"


def has_current(client: docker.DockerClient, ref: str, digest: str = "") -> bool:
    """The engine has `ref` and, when `digest` is given, as that digest (a tag pushed again
    since the engine pulled it is pulled again)."""
    try:
        image = client.images.get(ref)
    except docker.errors.ImageNotFound:
        return False
    if not digest:
        return True
    return any(d.endswith("@" + digest) for d in image.attrs.get("RepoDigests") or [])


def ensure(
    host, ref: str, *, cluster_id: int | None = None, digest: str = "", db: Callable | None = None
) -> bool:
    """Before a workspace or a replica is made from `ref` on `host`: an image of our
    registry the engine lacks (or has as an older digest) is pulled with the console's
    credentials, its progress kept on the cluster (`Cluster.image_pulls`, the cluster page
    reads it) and its start, end or failure on the cluster's timeline. False (and nothing
    done) for images of other registries: the caller makes its container and pulls on
    ImageNotFound, as before. Raises RegistryError, in words, when the pull fails. `db`: who
    runs its database work (`pull_public`)."""
    db = db or _direct
    if not in_registry(ref):
        return False
    client = engine.cached_client(host)
    if has_current(client, ref, digest):
        return True
    started = time.monotonic()
    db(_pull_state, cluster_id, host.name, state="pulling", done=0, total=0)
    db(
        _cluster_event,
        cluster_id,
        "pulling",
        Text(gettext_noop("pulling %(image)s onto %(host)s"), image=ref, host=host.name),
    )
    patient = engine.client_for(host, timeout=settings.SUANLI_IMAGE_PULL_S)
    got = {"total": 0}

    def progress(done: int, total: int) -> None:
        got["total"] = total
        db(_pull_state, cluster_id, host.name, state="pulling", done=done, total=total)

    try:
        # A reference by digest alone (a saved workspace, jobs/nodes/workspaces.py) is pulled as
        # that digest; one with a tag, by its tag (`digest` then says which it must be).
        name, _at, pinned = ref.partition("@")
        exact = pinned and ":" not in name.rpartition("/")[2]
        pull(patient, ref if exact else name, on_progress=progress)
    except RegistryError as exc:
        failed = Text(
            gettext_noop("the image %(image)s could not be pulled onto %(host)s: %(error)s"),
            image=ref,
            host=host.name,
            error=exc,
        )
        message = str(failed)
        db(_pull_state, cluster_id, host.name, state="failed", message=message)
        db(_cluster_event, cluster_id, "pull-failed", failed)
        raise RegistryError(message) from exc
    finally:
        patient.close()
    seconds = time.monotonic() - started
    db(_pull_state, cluster_id, host.name, state="pulled", done=got["total"], total=got["total"])
    db(
        _cluster_event,
        cluster_id,
        "pulled",
        Text(
            gettext_noop("%(image)s is on %(host)s (%(size)s in %(seconds)s s)"),
            image=ref,
            host=host.name,
            size=human(got["total"]),
            seconds=f"{seconds:.0f}",
        ),
    )
    return True


def _direct(fn, *args, **kwargs):
    return fn(*args, **kwargs)


def _pull_state(cluster_id, host_name: str, **state) -> None:
    """Keep how the pull onto `host_name` goes on the cluster (`Cluster.image_pulls`, which
    its page reads)."""
    if cluster_id is None:
        return
    with transaction.atomic():
        row = Cluster.objects.select_for_update().filter(pk=cluster_id).first()
        if row is None:
            return
        pulls = dict(row.image_pulls or {})
        was = pulls.get(host_name) or {}
        now = {"state": "pulling", "done": 0, "total": 0, "message": "", **state}
        # When it last moved (another state, or more bytes): a pull that has not moved
        # for minutes is not one to wait for (jobs/nodes/workspaces.py `stalled`).
        moved = (
            was.get("moved_at")
            if (was.get("state"), was.get("done")) == (now["state"], now["done"])
            else None
        )
        now["moved_at"] = moved or timezone.now().isoformat()
        pulls[host_name] = now
        Cluster.objects.filter(pk=cluster_id).update(image_pulls=pulls)


def _cluster_event(cluster_id, kind: str, message: str | Text) -> None:
    """The pull on the cluster's timeline, when the pull is for a cluster."""
    if cluster_id is not None:
        timeline.cluster_event(cluster_id, kind, message)


# -- sizes ----------------------------------------------------------------------------------


def distinct_bytes(images) -> int:
    """The bytes of the distinct layers of `images` (each a [[layer, bytes], ...] list): a
    layer several of them share is counted once."""
    distinct = {}
    for layers in images:
        for digest, size, *_rest in layers or []:
            distinct[digest] = int(size)
    return sum(distinct.values())


def real_layers(client: docker.DockerClient, ref: str) -> list[list]:
    """[[layer, bytes], ...] of an image on an engine: each layer of its root filesystem
    (by its uncompressed digest, the same on every host and in every image that shares
    it) with its size on disk. A layer the engine made here (a build's step, a commit)
    is the image's size less its parent's; the layers of a pulled image, which has no
    parent here, come from its history (its entries of a size, in order, are its layers;
    when they cannot be matched, its whole size goes on its newest layer: nothing is
    counted short)."""
    attrs = client.api.inspect_image(ref)
    top = list((attrs.get("RootFS") or {}).get("Layers") or [])
    if not top:
        return [[attrs["Id"], int(attrs.get("Size") or 0)]]
    sizes: dict[str, int] = {}
    while attrs.get("Parent"):
        try:
            parent = client.api.inspect_image(attrs["Parent"])
        except docker.errors.NotFound:
            break
        mine = (attrs.get("RootFS") or {}).get("Layers") or []
        theirs = (parent.get("RootFS") or {}).get("Layers") or []
        if mine[:-1] == theirs and len(mine) == len(theirs) + 1:
            sizes[mine[-1]] = int(attrs.get("Size") or 0) - int(parent.get("Size") or 0)
        elif mine != theirs:
            break
        attrs = parent
    base = list((attrs.get("RootFS") or {}).get("Layers") or [])
    total = int(attrs.get("Size") or 0)
    history = client.api.history(attrs["Id"])  # newest first
    found = [int(h.get("Size") or 0) for h in reversed(history) if int(h.get("Size") or 0) > 0]
    if base and len(found) == len(base) and sum(found) == total:
        sizes.update(zip(base, found, strict=True))
    elif base:
        sizes.update({d: 0 for d in base[:-1]} | {base[-1]: total})
    return [[d, max(0, sizes.get(d, 0))] for d in top]
