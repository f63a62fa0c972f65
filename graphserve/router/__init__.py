"""Routing requests among engine replicas by their cached prefixes: the policy (policy.py), and
`graphserve router`, its HTTP front over separate `graphserve serve` workers (app.py, workers.py)."""
