"""vLLM's KV cache events: what each instance's prefix cache holds, for kv-aware routing.

A room of its own above the backends: a subscription per instance that
publishes (``events``), its batches decoded (``wire``) and put in order
(``sequence``) over ZeroMQ in the reactor (``stream``, ``zmq_reactor``),
and the index of blocks they keep (``index``), by keys of the proxy's own
(``blocks``). The routing policies and the
decide rules read it through the ``Holdings`` protocols their rooms own.
"""
