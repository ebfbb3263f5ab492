"""The control plane under a given grpcio / protobuf: import the generated stubs, then a loopback
round trip (coordinator, a trainer and an engine agent with the no-op data plane, plan, refit,
outcome, worker listing).  Needs neither torch nor vLLM, so it runs in a bare venv::

    python -m venv /tmp/oldgrpc
    /tmp/oldgrpc/bin/pip install grpcio==1.66.0 grpcio-health-checking==1.66.0 protobuf==5.29.1
    PYTHONPATH=. /tmp/oldgrpc/bin/python tests/harness/grpc_compat_check.py

tests/integration/test_proto_compat.py runs it under the lowest versions when REFIT_OLD_GRPC_PYTHON names
such an interpreter.  Prints one line: ``OK grpcio=… protobuf=…``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import grpc
from google.protobuf import __version__ as protobuf_version

from refit.control.agent import EngineAgent, TrainerAgent
from refit.control.client import Client
from refit.control.dataplane import NoopDataPlane
from refit.spec import ModelConfig, build_spec

CONFIG = {"model_type": "qwen3_moe", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 48, "moe_intermediate_size": 16,
          "num_experts": 4, "vocab_size": 128, "torch_dtype": "bfloat16"}


def main() -> int:
    spec = build_spec("compat-moe", ModelConfig.from_hf(CONFIG))
    # The coordinator in a process of its own, as deployed (grpc.aio before 1.70 logs errors when
    # two event loops of one process poll it).
    code = "import sys; from refit.control.server import serve_main; sys.exit(serve_main(['--port', '0']))"
    server = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True, env=dict(os.environ))
    line = server.stderr.readline()
    if "listening on" not in line:
        server.kill()
        raise SystemExit(f"coordinator did not start: {line}")
    address = line.strip().rsplit(" ", 1)[1]
    agents = [TrainerAgent(address, group="trainer", rank=r, spec=spec, layout="megatron:tp2",
                           data_plane=NoopDataPlane()).start() for r in range(2)]
    engine = EngineAgent(address, group="engine", rank=0, spec=spec, layout="vllm:tp1",
                         data_plane=NoopDataPlane()).start()
    try:
        with Client(address) as client:
            assert client.health() == "SERVING"
            plan = client.create_plan("trainer", "engine")
            result = client.refit(plan["plan_id"], version=7, timeout=10.0)
            assert result.ok and set(result.workers) == {"trainer/0", "trainer/1", "engine/0"}, result
            end = time.monotonic() + 5
            while engine.version != 7 and time.monotonic() < end:
                time.sleep(0.01)
            assert (engine.version, engine.stale) == (7, False)
            rows = client.list_workers(role="engine")
            assert [(r["worker_id"], r["version"]) for r in rows] == [("engine/0", 7)], rows
    finally:
        for a in agents + [engine]:
            a.stop()
        server.terminate()
        server.wait(10)
    print(f"OK grpcio={grpc.__version__} protobuf={protobuf_version}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
