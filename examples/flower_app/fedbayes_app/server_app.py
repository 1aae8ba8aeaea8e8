"""The ServerApp: samples cohorts with its own PRNG key, sends the broadcast, screens and aggregates."""

import json

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

import fedbayes as fb
from fedbayes.flower import run_server

from .task import spec

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    try:
        result = run_server(spec(context.run_config, role="server"), grid)
    except fb.TooFewClientsError as err:  # a node died and the fault policy stops the run: say so, and fail it
        print("fedbayes stopped:", json.dumps({"error": type(err).__name__, "message": str(err)}))
        raise
    summary = {"params": {name: value.tolist() for name, value in result.params.items()},
               "ledger_bits": result.bits_up + result.bits_down,
               "payload_bytes": sum(m[3] for m in result.flower_messages)}
    print("fedbayes result:", json.dumps(summary))
