"""The bench: connectors against their raw engines, and an agentic workload replay."""
