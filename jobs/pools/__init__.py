"""Pools (a queue and identical clusters that grow and shrink, `autoscaler`) and sweeps
(trials searched by Optuna on a pool, `sweeps`), and GPU subscriptions ("tell me when 8 x
A100 are free", optionally renting them then: `subscriptions`).

Layer: pools, under tasks, admin and management; uses clusters and below.
"""
