"""The OpenAPI 3.0 description of /api/v1/, served at /api/v1/schema."""

from jobs.models import Cluster, Job

_ERROR = {"$ref": "#/components/schemas/Error"}


def _resp(description: str, schema=None) -> dict:
    out = {"description": description}
    if schema is not None:
        out["content"] = {"application/json": {"schema": schema}}
    return out


_COMMON = {
    "401": _resp("Missing, unknown or revoked token.", _ERROR),
    "429": _resp(
        "Too many requests for this token, or too many failed tokens or log-ins from this "
        "address (see Retry-After).",
        _ERROR,
    ),
}
_ID = {"type": "integer", "minimum": 1, "maximum": 2147483647}
_PAGE = {
    "name": "page",
    "in": "query",
    "required": False,
    "schema": {"type": "integer", "minimum": 1, "maximum": 100000},
}


def _path_id(name: str) -> dict:
    return {"name": name, "in": "path", "required": True, "schema": _ID}


SCHEMA = {
    "openapi": "3.0.3",
    "info": {
        "title": "Suanli API",
        "version": "1",
        "description": "GPU clusters, jobs and balance of the token's owner. Another researcher's objects are 404.",
    },
    "servers": [{"url": "/api/v1"}],
    "security": [{"bearerAuth": []}],
    "components": {
        "securitySchemes": {"bearerAuth": {"type": "http", "scheme": "bearer"}},
        "schemas": {
            "Error": {
                "type": "object",
                "required": ["error", "fields"],
                "properties": {
                    "error": {"type": "string"},
                    "fields": {
                        "type": "object",
                        "additionalProperties": {"type": "array", "items": {"type": "string"}},
                    },
                },
            },
            "Cluster": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer"},
                    "name": {"type": "string"},
                    "state": {"type": "string", "enum": [s for s, _ in Cluster.State.choices]},
                    "state_reason": {"type": "string"},
                    "gpu_model": {"type": "string", "nullable": True},
                    "instance_type": {"type": "string", "nullable": True},
                    "nodes": {"type": "integer"},
                    "gpus_per_node": {"type": "integer"},
                    "image": {"type": "string"},
                    "network": {"type": "string"},
                    "zone": {"type": "string"},
                    "spot": {"type": "boolean"},
                    "release_policy": {"type": "string"},
                    "url": {"type": "string"},
                    "created_at": {"type": "string", "format": "date-time"},
                    "running_since": {"type": "string", "format": "date-time", "nullable": True},
                    "released_at": {"type": "string", "format": "date-time", "nullable": True},
                },
            },
            "NewCluster": {
                "type": "object",
                "required": ["name", "nodes", "image"],
                "properties": {
                    "name": {
                        "type": "string",
                        "maxLength": 63,
                        "description": "lower-case letters, digits, dashes",
                    },
                    "gpu_model": {
                        "type": "string",
                        "description": "a GPU model's slug, e.g. a100-80gb",
                    },
                    "instance_type": {
                        "type": "string",
                        "description": "a CPU-only type's name (instead of gpu_model)",
                    },
                    "nodes": {"type": "integer", "minimum": 1, "maximum": 64},
                    "gpus_per_node": {"type": "integer", "minimum": 1, "maximum": 8},
                    "image": {
                        "type": "string",
                        "maxLength": 255,
                        "description": "a catalog image reference, or any other reference",
                    },
                    "network": {"type": "string", "enum": [s for s, _ in Cluster.Network.choices]},
                    "zone": {"type": "string", "maxLength": 40},
                    "spot": {"type": "boolean"},
                    "volumes": {
                        "type": "array",
                        "items": {"type": "string", "maxLength": 300},
                        "maxItems": 16,
                        "description": "storage-folder:/container/path[:ro]",
                    },
                    "release_policy": {
                        "type": "string",
                        "enum": [s for s, _ in Cluster.ReleasePolicy.choices],
                    },
                    "idle_minutes": {"type": "integer", "minimum": 1, "maximum": 10080},
                    "ssh_keys": {"type": "array", "items": _ID, "maxItems": 20},
                },
            },
            "Job": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer"},
                    "name": {"type": "string"},
                    "cluster": {"type": "integer"},
                    "state": {"type": "string", "enum": [s for s, _ in Job.State.choices]},
                    "state_reason": {"type": "string"},
                    "exit_code": {"type": "integer", "nullable": True},
                    "attempt": {"type": "integer"},
                    "launcher": {"type": "string"},
                    "command": {"type": "string"},
                    "url": {"type": "string"},
                    "created_at": {"type": "string", "format": "date-time"},
                    "started_at": {"type": "string", "format": "date-time", "nullable": True},
                    "finished_at": {"type": "string", "format": "date-time", "nullable": True},
                    "preemption_script": {"type": "string"},
                    "max_preemptions": {"type": "integer"},
                    "preemptions": {
                        "type": "integer",
                        "description": "times a spot preemption stopped it so far",
                    },
                    "resume_from": {
                        "type": "string",
                        "nullable": True,
                        "description": "the checkpoint the current attempt was started from "
                        "(its SUANLI_RESUME_FROM)",
                    },
                },
            },
            "NewJob": {
                "type": "object",
                "required": ["cluster", "name", "command"],
                "properties": {
                    "cluster": _ID,
                    "name": {"type": "string", "maxLength": 100},
                    "command": {"type": "string", "maxLength": 16384},
                    "launcher": {"type": "string", "enum": [s for s, _ in Job.Launcher.choices]},
                    "env": {"type": "object", "additionalProperties": {"type": "string"}},
                    "workdir": {"type": "string", "maxLength": 255},
                    "checkpoint_dir": {"type": "string", "maxLength": 255},
                    "max_runtime_min": {"type": "integer", "minimum": 1, "maximum": 43200},
                    "retries": {"type": "integer", "minimum": 0, "maximum": 10},
                    "preemption_script": {
                        "type": "string",
                        "maxLength": 16384,
                        "description": "spot clusters: run in each replica with /bin/sh -c "
                        "when a preemption notice arrives (e.g. save a checkpoint)",
                    },
                    "max_preemptions": {
                        "type": "integer",
                        "minimum": 0,
                        "maximum": 100,
                        "default": 5,
                        "description": "preemptions the job survives; one more fails it",
                    },
                },
            },
        },
    },
    "paths": {
        "/clusters": {
            "get": {
                "summary": "Your clusters, newest first (50 a page).",
                "parameters": [_PAGE],
                "responses": {
                    "200": _resp("A page of clusters.", {"type": "object"}),
                    "400": _resp("Bad page.", _ERROR),
                    **_COMMON,
                },
            },
            "post": {
                "summary": "Request a cluster (the same checks as the form, including the balance).",
                "requestBody": {
                    "required": True,
                    "content": {
                        "application/json": {"schema": {"$ref": "#/components/schemas/NewCluster"}}
                    },
                },
                "responses": {
                    "201": _resp(
                        "Requested; it runs once placed.", {"$ref": "#/components/schemas/Cluster"}
                    ),
                    "400": _resp("Invalid input: a message per field.", _ERROR),
                    **_COMMON,
                },
            },
        },
        "/clusters/{cluster_id}": {
            "get": {
                "parameters": [_path_id("cluster_id")],
                "responses": {
                    "200": _resp("The cluster.", {"$ref": "#/components/schemas/Cluster"}),
                    "404": _resp("Not yours or no such cluster.", _ERROR),
                    **_COMMON,
                },
            }
        },
        "/clusters/{cluster_id}/release": {
            "post": {
                "summary": "Give the capacity back now (idempotent).",
                "parameters": [_path_id("cluster_id")],
                "responses": {
                    "200": _resp("Released.", {"$ref": "#/components/schemas/Cluster"}),
                    "404": _resp("Not found.", _ERROR),
                    **_COMMON,
                },
            }
        },
        "/clusters/{cluster_id}/resize": {
            "post": {
                "summary": "Change a running cluster's node count (more nodes: placed now or "
                "refused, and the balance must cover them as for a new cluster).",
                "parameters": [_path_id("cluster_id")],
                "requestBody": {
                    "required": True,
                    "content": {
                        "application/json": {
                            "schema": {
                                "type": "object",
                                "required": ["nodes"],
                                "properties": {"nodes": {"type": "integer", "minimum": 1}},
                            }
                        }
                    },
                },
                "responses": {
                    "200": _resp("Resized.", {"$ref": "#/components/schemas/Cluster"}),
                    "400": _resp(
                        "Refused: not running, a job runs, no room, or not enough balance.",
                        _ERROR,
                    ),
                    "404": _resp("Not found.", _ERROR),
                    **_COMMON,
                },
            }
        },
        "/jobs": {
            "get": {
                "parameters": [
                    _PAGE,
                    {"name": "cluster", "in": "query", "required": False, "schema": _ID},
                ],
                "responses": {
                    "200": _resp("A page of jobs.", {"type": "object"}),
                    "400": _resp("Bad filter.", _ERROR),
                    **_COMMON,
                },
            },
            "post": {
                "summary": "Queue a job on one of your clusters.",
                "requestBody": {
                    "required": True,
                    "content": {
                        "application/json": {"schema": {"$ref": "#/components/schemas/NewJob"}}
                    },
                },
                "responses": {
                    "201": _resp("Queued.", {"$ref": "#/components/schemas/Job"}),
                    "400": _resp("Invalid input, or the cluster takes no jobs.", _ERROR),
                    "404": _resp("No such cluster of yours.", _ERROR),
                    **_COMMON,
                },
            },
        },
        "/jobs/{job_id}": {
            "get": {
                "parameters": [_path_id("job_id")],
                "responses": {
                    "200": _resp("The job.", {"$ref": "#/components/schemas/Job"}),
                    "404": _resp("Not found.", _ERROR),
                    **_COMMON,
                },
            }
        },
        "/jobs/{job_id}/cancel": {
            "post": {
                "parameters": [_path_id("job_id")],
                "responses": {
                    "200": _resp(
                        "Cancelled (queued) or stopping (SIGTERM, then SIGKILL).",
                        {"$ref": "#/components/schemas/Job"},
                    ),
                    "400": _resp("Nothing to cancel.", _ERROR),
                    "404": _resp("Not found.", _ERROR),
                    **_COMMON,
                },
            }
        },
        "/jobs/{job_id}/log": {
            "get": {
                "summary": "The current attempt's log, rank-labelled: live from the engines "
                "while it runs, the stored log once it has ended (`complete` then).",
                "parameters": [
                    _path_id("job_id"),
                    {
                        "name": "since",
                        "in": "query",
                        "required": False,
                        "description": "the `cursor` of an earlier answer: only the lines "
                        "after it (first the rest of the attempt it was reading, if the job "
                        "has started another since); poll with each answer's cursor to follow "
                        "the log",
                        "schema": {
                            "type": "string",
                            "maxLength": 2400,
                            "pattern": r"^\d{1,5}(~\d{1,3}\.\d{1,20}\.\d{1,9}){0,64}$",
                        },
                    },
                ],
                "responses": {
                    "200": _resp(
                        "Log lines.",
                        {
                            "type": "object",
                            "properties": {
                                "job": {"type": "integer"},
                                "state": {"type": "string"},
                                "attempt": {
                                    "type": "integer",
                                    "description": "the attempt these lines are from",
                                },
                                "exit_code": {"type": "integer", "nullable": True},
                                "complete": {
                                    "type": "boolean",
                                    "description": "the job has ended and no line is left "
                                    "after this answer",
                                },
                                "lines": {
                                    "type": "array",
                                    "items": {
                                        "type": "object",
                                        "properties": {
                                            "ts": {"type": "string"},
                                            "rank": {"type": "integer"},
                                            "text": {"type": "string"},
                                        },
                                    },
                                },
                                "cursor": {
                                    "type": "string",
                                    "description": "pass as `since` for the lines after these",
                                },
                            },
                        },
                    ),
                    "400": _resp("Not a cursor of this job.", _ERROR),
                    "404": _resp("Not found.", _ERROR),
                    **_COMMON,
                },
            }
        },
        "/balance": {
            "get": {
                "summary": "Balance, burn rate and the 50 newest ledger entries (amounts are decimal strings).",
                "responses": {"200": _resp("Where you stand.", {"type": "object"}), **_COMMON},
            }
        },
        "/schema": {
            "get": {
                "security": [],
                "responses": {"200": _resp("This document.", {"type": "object"})},
            }
        },
    },
}
