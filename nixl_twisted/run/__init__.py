"""The process: the composition root, ports, signals, reloads, workers and their coordination."""
