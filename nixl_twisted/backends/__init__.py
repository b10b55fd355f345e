"""The vLLM side: instances, their pools and health, routing policies, the upstream client."""
