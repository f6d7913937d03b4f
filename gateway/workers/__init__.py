"""``gateway serve --workers N``: N data-plane processes and one control plane per node.

- :mod:`gateway.workers.supervisor`: the supervising process, which is also the control plane
  (admin API, console, rollout controller, state sync, fleet health, ``/metrics``), and why;
- :mod:`gateway.workers.worker`: one data-plane worker (its own ``SO_REUSEPORT`` listeners);
- :mod:`gateway.workers.channel`: the Unix-socket channel between them;
- :mod:`gateway.workers.deltas`: recorder deltas, taken in a worker and merged exactly;
- :mod:`gateway.workers.pins`: the node's sequence pins, shared by every worker.

With one worker (the default) none of this runs: ``gateway serve`` is the single process it
always was.
"""
