"""Researchers' own images: built from a Dockerfile on a build host or saved from a
workspace, pushed to the registry, counted against a quota, deleted (`builds`); the
build's engine calls that docker-py's public API cannot make, in one adapter with
docker-py pinned (`engine_build`).

Layer: images, beside access and runs; uses nodes and below.
"""
