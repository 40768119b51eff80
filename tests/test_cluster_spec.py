"""The cluster spec (jobs/clusters/spec.py) is where a new cluster's rules live: a request
given as it came (the API's way) is refused with the same words, on the same fields, as
the console's form that parses its fields first and asks the spec for the rest."""

from functools import partial

import pytest

from console.forms import ClusterForm, check_funds
from jobs.clusters.spec import CUSTOM, ClusterRequest, Offer
from jobs.models import Image
from tests.forms_data import cluster_form


@pytest.fixture
def hosts(make_paper_host, priced):
    make_paper_host("gpu-paper-a", zone="zone-a", gpus=8)
    make_paper_host("gpu-paper-b", zone="zone-b", gpus=8)


def _as_given(data: dict, owner) -> ClusterRequest:
    """The form's fields as an unparsed request: text and ids as they came."""
    choice = data["image"]
    image = CUSTOM if choice == "custom" else Image.objects.filter(pk=choice).first()
    return ClusterRequest(
        owner=owner,
        name=data["name"],
        resource=data["resource"],
        nodes=data["nodes"],
        gpus_per_node=data["gpus_per_node"],
        image=image,
        custom_image=data["custom_image"] if image == CUSTOM else None,
        network=data["network"],
        zone=data["zone"],
        volumes=data["volumes"],
        release_policy=data["release_policy"],
        idle_minutes=data["idle_minutes"],
        spot=bool(data.get("spot")),
        pub=bool(data.get("pub")),
        workspace=bool(data.get("workspace")),
    )


def _words(errors: dict) -> dict[str, list[str]]:
    """Each field's messages as text (a ValidationError as its own words)."""
    return {
        name: [w for m in messages for w in (m.messages if hasattr(m, "messages") else [str(m)])]
        for name, messages in errors.items()
    }


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"name": ""},
        {"name": "x" * 70},
        {"name": "Bad Name!", "nodes": "0"},
        {"nodes": "99"},
        {"gpus_per_node": "9"},
        {"gpus_per_node": ""},
        {"resource": "gpu:b200"},
        {"resource": "gpu:t4-16gb"},
        {"zone": "zone-x"},
        {"network": "rdma"},
        {"image": "custom", "custom_image": "Not An Image!"},
        {"image": "custom", "custom_image": ""},
        {"image": "custom", "custom_image": "x" * 300},
        {"volumes": "data:/etc"},
        {"volumes": "a:/workspace/x\nb:/workspace/x"},
        {"release_policy": "idle"},
        {"release_policy": "idle", "idle_minutes": "0"},
        {"release_policy": "sometimes"},
        {"nodes": "2", "gpus_per_node": "8", "zone": "zone-a"},
    ],
)
def test_a_request_as_given_is_refused_as_the_form_refuses_it(alice, hosts, fields):
    data = cluster_form(**fields)
    form = ClusterForm(data, owner=alice)
    form.is_valid()
    checked = _as_given(data, alice).check(Offer.of(alice), funds=partial(check_funds, alice))
    assert _words(checked.errors) == _words(form.errors)
    assert (checked.spec is None) == bool(form.errors)


def test_a_good_request_is_the_spec_the_form_makes(alice, hosts):
    data = cluster_form(
        nodes="2", gpus_per_node="4", zone="zone-b", volumes="data:/workspace/data:ro"
    )
    form = ClusterForm(data, owner=alice)
    assert form.is_valid(), form.errors
    spec = _as_given(data, alice).validate(Offer.of(alice), funds=lambda **kw: _Funds())
    assert spec == form.spec()
    assert (spec.nodes, spec.gpus_per_node, spec.zone) == (2, 4, "zone-b")
    assert [(v.source, v.target, v.read_only) for v in spec.volumes] == [
        ("data", "/workspace/data", True)
    ]


def test_the_balance_is_the_callers_and_its_refusal_is_the_clusters_as_a_whole(alice, hosts):
    """A balance too short: one sentence for the cluster as a whole, the amounts kept for
    the page's top-up note; a shape with no price: on the resource."""
    request = _as_given(cluster_form(nodes="1", gpus_per_node="8"), alice)
    checked = request.check(Offer.of(alice), funds=lambda **kw: _Funds(short=True))
    assert list(checked.errors) == ["__all__"] and checked.spec is None
    assert "creating it needs a balance for" in checked.errors["__all__"][0]
    assert checked.funds_short == {"needed": 1}
    checked = request.check(Offer.of(alice), funds=lambda **kw: None)
    assert list(checked.errors) == ["resource"] and checked.funds_short is None
    assert "A100 80 GB has no price on the rate card yet" in checked.errors["resource"][0]


class _Funds:
    def __init__(self, short=False):
        self.short = short

    def refusal(self, message, **extra):
        return message

    def as_context(self):
        return {"needed": 1}
