"""The starting rate card an operator gets (and versions in the admin afterwards)."""

from decimal import Decimal

from django.db import transaction

from billing.models import Price, RateCard
from jobs.models import GpuModel, InstanceType

# Per GPU-hour / per instance-hour, CNY: in the range Chinese GPU clouds list publicly.
GPU_PRICES = {
    "t4-16gb": "1.2000",
    "a10-24gb": "2.4000",
    "a100-40gb": "5.2000",
    "a100-80gb": "7.8000",
    "h100-80gb": "16.0000",
}
CPU_PRICES = {"cpu-2c-4g": "0.3000", "cpu-4c-16g": "0.8000", "cpu-8c-32g": "1.5000"}


@transaction.atomic
def seed_rate_card(*, effective_from=None) -> RateCard | None:
    """The first rate card, when there is none yet (an operator's later versions stay)."""
    if RateCard.objects.exists():
        return None
    fields = {"note": "starting prices", "spot_discount_pct": Decimal("50")}
    if effective_from is not None:
        fields["effective_from"] = effective_from
    card = RateCard.objects.create(**fields)
    for model in GpuModel.objects.filter(slug__in=GPU_PRICES):
        Price.objects.create(card=card, gpu_model=model, per_hour=Decimal(GPU_PRICES[model.slug]))
    for itype in InstanceType.objects.filter(name__in=CPU_PRICES):
        Price.objects.create(
            card=card, instance_type=itype, per_hour=Decimal(CPU_PRICES[itype.name])
        )
    return card
