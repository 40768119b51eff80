"""bench/storage: the researchers' distributed filesystem (MooseFS) inside a container on a
test host, beside the same work on that host's local disk (an engine volume on its data
root), in the same run and the same container:

- a 1 GiB sequential write (dd, fsync at the end) and its read back, the page cache
  dropped in between (machine-wide: `echo 3 > /proc/sys/vm/drop_caches`, root);
- creating 10,000 small files (1 KiB each) in one folder.

Each case prints one JSON line: both figures and the distributed filesystem's as a ratio
of the local disk's (below 1: slower). On the test fleet the master and chunkserver share
this machine's disk with everything else, so the ratio says what FUSE and the network hop
cost, not what a fleet of storage servers gives.
"""

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import docker
from docker.types import Mount

ENGINE = [u for u in os.environ["SUANLI_TEST_ENGINES"].split(",") if u][0]
IMAGE = os.environ.get("SUANLI_TEST_IMAGE", "suanli/busybox:latest")
ROOT = Path(os.environ["SUANLI_STORAGE_ROOT"])
MIB = int(os.environ.get("BENCH_STORAGE_MIB", 1024))
FILES = int(os.environ.get("BENCH_STORAGE_FILES", 10_000))


def timed(container, script: str) -> float:
    started = time.perf_counter()
    code, out = container.exec_run(["sh", "-c", script])
    took = time.perf_counter() - started
    if code != 0:
        sys.exit(f"bench/storage: {script!r} failed ({code}): {out.decode(errors='replace')}")
    return took


def drop_caches() -> None:
    subprocess.run(["sync"], check=True)
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def line(case: str, dfs_s: float, local_s: float, **extra) -> None:
    print(
        json.dumps(
            {
                "bench": "storage",
                "case": case,
                "moosefs_s": round(dfs_s, 3),
                "local_disk_s": round(local_s, 3),
                "moosefs_vs_local": round(local_s / dfs_s, 3),
                **extra,
            }
        ),
        flush=True,
    )


def main() -> None:
    if os.environ.get("SUANLI_STORAGE_FS") != "moosefs":
        sys.exit("bench/storage: run under `make bench` (the test fleet's MooseFS)")
    folder = ROOT / f"bench-storage-{uuid.uuid4().hex[:8]}"
    folder.mkdir(parents=True)
    client = docker.DockerClient(base_url=ENGINE, timeout=600)
    container = client.containers.run(
        IMAGE, ["sleep", "3600"], detach=True, network_mode="none",
        labels={"suanli.bench": "storage"},
        mounts=[Mount("/dfs", str(folder), type="bind"), Mount("/local", None, type="volume")],
    )  # fmt: skip
    try:
        write = {}
        read = {}
        small = {}
        for where in ("dfs", "local"):
            write[where] = timed(
                container,
                f"dd if=/dev/zero of=/{where}/big bs=1M count={MIB} conv=fsync 2>/dev/null",
            )
        drop_caches()
        for where in ("dfs", "local"):
            read[where] = timed(container, f"dd if=/{where}/big of=/dev/null bs=1M 2>/dev/null")
            timed(container, f"rm -f /{where}/big")
        for where in ("dfs", "local"):
            small[where] = timed(
                container,
                # The shell's own printf (no process per file): the filesystem's cost.
                f"mkdir /{where}/small && cd /{where}/small "
                f"&& i=0; while [ $i -lt {FILES} ]; do printf '%1024s' > f$i; i=$((i+1)); done",
            )
        mb = MIB * 1024 * 1024 / 1e6
        line(f"seq_write_{MIB}mib", write["dfs"], write["local"],
             moosefs_mb_s=round(mb / write["dfs"], 1), local_mb_s=round(mb / write["local"], 1))  # fmt: skip
        line(f"seq_read_{MIB}mib", read["dfs"], read["local"],
             moosefs_mb_s=round(mb / read["dfs"], 1), local_mb_s=round(mb / read["local"], 1))  # fmt: skip
        line(f"small_files_{FILES}", small["dfs"], small["local"],
             moosefs_files_s=round(FILES / small["dfs"]), local_files_s=round(FILES / small["local"]))  # fmt: skip
    finally:
        container.remove(force=True, v=True)
        client.close()
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
