"""The ClientApp: one client's steps; its state lives in context.state and its data stay on the node."""

from fedbayes.flower import client_app

from .task import spec

app = client_app(spec)  # the spec is built from the run config (`[tool.flwr.app.config]`) on first use
