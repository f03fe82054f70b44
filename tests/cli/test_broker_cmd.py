import signal
import socket
import subprocess
import sys

from xronos.cli.main import build_parser
from xronos.common.ports import free_port
from xronos.protocol.transport import BrokerSettings, MqttBus


def _interruptible():
    # As at a terminal: a suite started in the background (`cmd &` without job control) passes
    # SIGINT on ignored, and Python then installs no KeyboardInterrupt handler, so Ctrl-C is lost.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _spawn(port):
    return subprocess.Popen([sys.executable, "-m", "xronos.cli", "broker", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_interruptible)


def _listening_line(proc):
    while line := proc.stdout.readline():
        if line.startswith("xronos broker: listening"):
            return line
    raise AssertionError(f"broker exited: {proc.wait()} {proc.stderr.read()}")


def test_broker_listed_in_help():
    assert "broker" in build_parser().format_help()


def test_broker_accepts_a_client_and_stops_on_ctrl_c():
    port = free_port()
    proc = _spawn(port)
    try:
        assert f"127.0.0.1:{port}" in _listening_line(proc)
        bus = MqttBus(BrokerSettings(port=port), "cli-test")
        bus.start()
        assert bus.wait_connected(5)
        bus.subscribe("t/#")
        bus.publish("t/x", b"hello")
        assert bus.get(5) == ("t/x", b"hello")
        bus.stop(flush_timeout=0.5)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(10) == 0
    finally:
        proc.kill()
        proc.wait()


def test_port_in_use_is_one_clean_error_line():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        proc = _spawn(s.getsockname()[1])
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 2
    assert "xronos broker: error: embedded broker cannot listen on" in err
    assert "Traceback" not in err
