"""What is observed of each request: the access event, the metrics, the traces, the refusals."""
