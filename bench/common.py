"""What the benches share: hosts registered the way an operator's script would."""

import io

from django.core.management import call_command


def register_host(name: str, engine_url: str, *, gpus: int, model: str = "a100-80gb") -> None:
    call_command(
        "register_host", name=name, engine=engine_url, zone="zone-a", gpu_model=model, gpus=gpus,
        stdout=io.StringIO(), stderr=io.StringIO(),
    )  # fmt: skip
