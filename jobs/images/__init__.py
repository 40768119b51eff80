"""Researchers' own images: built from a Dockerfile on a build host or saved from a
workspace, pushed to the registry, counted against a quota, deleted (`builds`).

Layer: images, beside access and runs; uses nodes and below.
"""
