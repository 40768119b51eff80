"""The form of *Hosts -> Add*: what the operator decides for a host before it joins (its
zone, its GPUs where it has no NVIDIA runtime, whether it builds images, and its address
when it reaches the console through NAT). The rest the host says itself (jobs/hosts/joins.py)."""

from django import forms
from django.utils.translation import gettext_lazy

from jobs.models import MAX_GPUS_PER_HOST, GpuModel


class JoinTokenForm(forms.Form):
    zone = forms.SlugField(
        max_length=40,
        initial="zone-a",
        label=gettext_lazy("Zone"),
        help_text=gettext_lazy("The zone researchers pick on the cluster form, e.g. zone-a."),
    )
    gpu_model = forms.ModelChoiceField(
        queryset=GpuModel.objects.all(),
        required=False,
        label=gettext_lazy("GPU model"),
        empty_label=gettext_lazy("as nvidia-smi says (none: CPU only)"),
        help_text=gettext_lazy(
            "Where the host has NVIDIA GPUs, their count comes from nvidia-smi and their "
            "model from the catalog's name for it; pick one when the names differ. On a "
            "host without them, a model here makes emulated GPUs (development, CI)."
        ),
    )
    gpu_count = forms.IntegerField(
        min_value=0,
        max_value=MAX_GPUS_PER_HOST,
        initial=0,
        label=gettext_lazy("Emulated GPUs"),
        help_text=gettext_lazy("Only for a host without NVIDIA GPUs and with a model above."),
    )
    build_host = forms.BooleanField(
        required=False,
        label=gettext_lazy("Builds researchers' images"),
    )
    address = forms.GenericIPAddressField(
        required=False,
        label=gettext_lazy("Address behind NAT"),
        help_text=gettext_lazy(
            "Leave empty: the host's address is the one its request comes from. Fill in only "
            "when the host reaches the console through NAT: its address on the hosts' network."
        ),
    )

    def clean(self):
        data = super().clean()
        if data.get("gpu_model") is None and data.get("gpu_count"):
            self.add_error("gpu_count", gettext_lazy("Pick the GPU model of the emulated GPUs."))
        return data
