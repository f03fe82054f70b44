"""The gateway must run on a small box that never installs torch: its whole import closure,
including the service and its CLI commands, stays free of torch and transformers."""

import pkgutil
import subprocess
import sys
from pathlib import Path

import xronos.gateway


def test_no_gateway_module_imports_torch():
    modules = [m.name for m in pkgutil.walk_packages(xronos.gateway.__path__, "xronos.gateway.")]
    assert {"xronos.gateway.service", "xronos.gateway.plan.planner", "xronos.gateway.job.machine"} <= set(modules)
    code = "; ".join(f"import {m}" for m in modules + ["xronos.cli.gateway", "xronos.cli.job", "xronos.cli.nodes"])
    code += "; import sys; print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers', 'datasets'}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).parent)
    assert out.stdout.strip() == "[]", out.stdout


def test_the_pure_cores_import_no_transport():
    """The planner, the cost models and the job state machine are pure logic (ARCHITECTURE.md):
    tested without a broker, so their import closure holds no MQTT client, socket server or torch."""
    pure = ["xronos.gateway.plan.planner", "xronos.gateway.plan.costmodel", "xronos.gateway.plan.overlapcost",
            "xronos.gateway.plan.rebalance", "xronos.gateway.job.machine"]
    code = "; ".join(f"import {m}" for m in pure)
    code += ("; import sys; print(sorted({m.split('.')[0] for m in sys.modules} & "
             "{'torch', 'transformers', 'datasets', 'paho', 'amqtt', 'socketserver', 'structlog'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).parent)
    assert out.stdout.strip() == "[]", out.stdout
