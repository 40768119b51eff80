"""Pools (a queue and identical clusters that grow and shrink, `autoscaler`) and sweeps
(trials searched by Optuna on a pool, `sweeps`).

Layer: pools, under tasks, admin and management; uses clusters and below.
"""
