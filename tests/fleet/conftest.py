"""The fleet tests use the same real broker, service and process fixtures as the agent's."""

from tests.agent.conftest import broker, service, spawn  # noqa: F401  (pytest fixtures)
