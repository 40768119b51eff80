"""What the benches share: hosts registered the way an operator's script would."""

import io

from django.core.management import call_command


def register_host(name: str, engine_url: str, *, gpus: int, model: str = "a100-80gb") -> None:
    call_command(
        "register_host", name=name, engine=engine_url, zone="zone-a", gpu_model=model, gpus=gpus,
        stdout=io.StringIO(), stderr=io.StringIO(),
    )  # fmt: skip


class EngineCalls:
    """A counting proxy in front of engines' unix sockets: `url(engine)` is a socket that
    forwards to `engine` and counts each HTTP request on its way (method and path, the
    API version, ids and names folded: `POST /containers/{id}/start`). For a bench's
    breakdown of engine round trips; it adds a hop, so a timed figure is taken without it."""

    def __init__(self, folder: str):
        import collections
        import threading

        self.folder = folder
        self.calls: collections.Counter = collections.Counter()
        self._lock = threading.Lock()
        self._servers = []

    def url(self, engine: str) -> str:
        import os
        import socket
        import threading

        target = engine.removeprefix("unix://")
        path = os.path.join(self.folder, f"engine-{len(self._servers)}.sock")
        if os.path.exists(path):
            os.unlink(path)
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(path)
        server.listen(256)
        self._servers.append(server)

        def accept():
            while True:
                try:
                    client, _ = server.accept()
                except OSError:
                    return
                upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                upstream.connect(target)
                threading.Thread(
                    target=self._pipe, args=(client, upstream, True), daemon=True
                ).start()
                threading.Thread(
                    target=self._pipe, args=(upstream, client, False), daemon=True
                ).start()

        threading.Thread(target=accept, daemon=True).start()
        return f"unix://{path}"

    def _pipe(self, src, dst, requests: bool) -> None:
        import re

        line = re.compile(rb"(?:^|\r\n)(GET|POST|PUT|DELETE|HEAD) (\S+) HTTP/1\.[01]\r\n")
        tail = b""
        try:
            while data := src.recv(65536):
                if requests:
                    seen = tail + data
                    for m in line.finditer(seen):
                        if m.end() > len(tail):
                            self._count(m.group(1).decode(), m.group(2).decode())
                    tail = seen[-512:]
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(2)
                except OSError:
                    pass

    def _count(self, method: str, path: str) -> None:
        import re

        path = re.sub(r"^/v[0-9.]+", "", path.split("?", 1)[0])
        path = re.sub(r"^/images/.+/(json|tag|push|history)$", r"/images/{name}/\1", path)
        path = re.sub(
            r"^/(containers|networks|exec|volumes)/(?!create$|prune$)[^/]+", r"/\1/{id}", path
        )
        with self._lock:
            self.calls[f"{method} {path}"] += 1

    def take(self) -> dict:
        """The calls counted since the last take, most first."""
        with self._lock:
            calls, self.calls = dict(self.calls.most_common()), type(self.calls)()
        return calls

    def close(self) -> None:
        for server in self._servers:
            server.close()
