"""The CloudNativePG example (deploy/k8s/cnpg/cluster.yaml) asks for what the promise needs of the
database: at least three instances, a commit answered only once a standby has it, and no primary
going on alone when the standbys are gone.

kubernetes-validate knows Kubernetes' own kinds, not CloudNativePG's ``Cluster`` (a custom
resource), so the fields used are checked here against a schema written from the operator's CRD
(``postgresql.cnpg.io/v1``, ``spec.postgresql.synchronous``; CloudNativePG 1.25 or later): an unknown
or misspelt field, or a value the CRD does not allow, fails.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

EXAMPLE = Path(__file__).resolve().parents[1] / "deploy" / "k8s" / "cnpg" / "cluster.yaml"

# The CRD's types and enums for the fields the example sets; closed objects where it sets them all.
SYNCHRONOUS = {
    "type": "object",
    "required": ["method", "number"],
    "additionalProperties": False,
    "properties": {
        "method": {"enum": ["any", "first"]},
        "number": {"type": "integer"},
        "dataDurability": {"enum": ["required", "preferred"]},
        "maxStandbyNamesFromCluster": {"type": "integer"},
        "standbyNamesPre": {"type": "array", "items": {"type": "string"}},
        "standbyNamesPost": {"type": "array", "items": {"type": "string"}},
        "failoverQuorum": {"type": "boolean"},
    },
}
SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "postgresql.cnpg.io/v1"},
        "kind": {"const": "Cluster"},
        "metadata": {"type": "object", "required": ["name", "namespace"]},
        "spec": {
            "type": "object",
            "required": ["instances", "postgresql", "storage"],
            "properties": {
                "instances": {"type": "integer", "minimum": 1},
                "imageName": {"type": "string"},
                "primaryUpdateStrategy": {"enum": ["unsupervised", "supervised"]},
                "postgresql": {
                    "type": "object",
                    "properties": {
                        "synchronous": SYNCHRONOUS,
                        "parameters": {"type": "object", "additionalProperties": {"type": "string"}},
                    },
                },
                "affinity": {
                    "type": "object",
                    "properties": {
                        "enablePodAntiAffinity": {"type": "boolean"},
                        "topologyKey": {"type": "string"},
                        "podAntiAffinityType": {"enum": ["preferred", "required"]},
                    },
                },
                "bootstrap": {
                    "type": "object",
                    "properties": {
                        "initdb": {
                            "type": "object",
                            "properties": {"database": {"type": "string"}, "owner": {"type": "string"}},
                        }
                    },
                },
                "storage": {"type": "object", "required": ["size"], "properties": {"size": {"type": "string"}}},
            },
        },
    },
}


@pytest.fixture(scope="module")
def cluster() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    return loaded


def test_the_example_has_the_fields_and_values_the_crd_allows(cluster: dict[str, Any]) -> None:
    jsonschema.validate(cluster, SCHEMA)


def test_the_schema_refuses_a_misspelt_field(cluster: dict[str, Any]) -> None:
    broken = yaml.safe_load(yaml.safe_dump(cluster))
    broken["spec"]["postgresql"]["synchronous"]["dataDurabilty"] = "required"
    with pytest.raises(jsonschema.ValidationError, match="dataDurabilty"):
        jsonschema.validate(broken, SCHEMA)


def test_every_answered_commit_is_on_a_standby_and_no_primary_goes_on_alone(cluster: dict[str, Any]) -> None:
    spec = cluster["spec"]
    sync = spec["postgresql"]["synchronous"]
    assert spec["instances"] >= 3, "a primary and two standbys: one standby may be lost and commits go on"
    assert 1 <= sync["number"] < spec["instances"], sync
    # `required` (CloudNativePG's default since 1.25, written out): with no standby left, commits wait.
    assert sync["dataDurability"] == "required", sync
    assert spec["affinity"]["podAntiAffinityType"] == "required", "two instances on one node die together"


def test_the_example_lives_where_the_services_look(cluster: dict[str, Any]) -> None:
    """The overlays' namespace, and the database the services' URL names."""
    assert cluster["metadata"]["namespace"] == "quayutec"
    assert cluster["spec"]["bootstrap"]["initdb"]["database"] == "quayutec"
