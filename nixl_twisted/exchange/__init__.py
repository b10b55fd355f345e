"""One client request served over its legs: two-leg exchanges, one-leg routes, batches, relay."""
