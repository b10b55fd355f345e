"""The protocol as the proxy speaks it, without I/O: routes, lowering, headers, phases, errors."""
