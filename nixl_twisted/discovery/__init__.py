"""Discovery: instances that come and go, found by DNS name or Kubernetes selector.

Each source (``dns``: a ``dns+``/``dnssrv+`` pool member; ``kubernetes``: a
``--prefill-selector``/``--decode-selector``) reports what it finds to the
``Membership``, which applies it to the pools as a reload would (new
instances checked before they take legs, vanished ones drained) and keeps the
last known instances through errors. ``Discovery`` is the service that runs
the sources; under ``--workers`` only the supervisor runs it and hands every
worker the same membership.
"""
