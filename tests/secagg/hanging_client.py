"""A client process that hangs in training, for the heartbeat-timeout test.

``python hanging_client.py ADDRESS PKI_FOLDER INDEX`` joins over mutual TLS as
``client-<INDEX>``, prints ``fitting`` when its first fit starts and then blocks. The
test stops the whole process (SIGSTOP) at that point: its heartbeat thread stops with it
while its sockets stay open, as in a process hung in a driver call.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

from fedloom import Weights
from fedloom.client_sdk import Client, EvaluateOutput, FitOutput, start_client
from fedloom.config import ClientConfig
from fedloom.types import Config


class HangingClient(Client):
    def fit(self, weights: Weights, config: Config) -> FitOutput:
        print("fitting", flush=True)
        threading.Event().wait()
        raise AssertionError("unreachable")

    def evaluate(self, weights: Weights, config: Config) -> EvaluateOutput:
        raise RuntimeError("this client only hangs")


def main() -> None:
    address, pki, index = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    config = ClientConfig(server_address=address, rpc_timeout_s=10.0,
                          root_ca=str(pki / "ca.pem"), cert=str(pki / f"client-{index}.pem"),
                          key=str(pki / f"client-{index}.key"))
    start_client(address, HangingClient(), config=config, log_to_console=False)


if __name__ == "__main__":
    main()
