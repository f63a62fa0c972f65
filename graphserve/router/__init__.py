"""`graphserve router`: routing requests among `graphserve serve` workers by their cached prefixes, over HTTP
(app.py, workers.py). The policy lives in engine/routing_policy.py, below the server, which routes among its
own `--dp` replicas with it."""
