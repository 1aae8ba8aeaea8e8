"""The ClientApp: one client's steps; its state lives in context.state and its data stay on the node."""

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from fedbayes.flower import client_app

from .task import spec

app = ClientApp()
_apps = {}


def _app(context: Context) -> ClientApp:
    key = tuple(sorted(context.run_config.items()))
    if key not in _apps:
        _apps[key] = client_app(spec(context.run_config))
    return _apps[key]


@app.train("step")
def step(msg: Message, context: Context) -> Message:
    return _app(context)(msg, context)


@app.train("finish")
def finish(msg: Message, context: Context) -> Message:
    return _app(context)(msg, context)


@app.query("hello")
def hello(msg: Message, context: Context) -> Message:
    return _app(context)(msg, context)


@app.query("state")
def state(msg: Message, context: Context) -> Message:
    return _app(context)(msg, context)
