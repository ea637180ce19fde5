"""The straggler report's wording and rank 0's switch, in this process (tests/e2e/test_stragglers.py runs
the detector in a real job)."""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest

from training.errors import ConfigError
from training.faults.stragglers import Switch, describe


def test_the_report_names_the_slowest_and_fastest_ranks_against_the_median():
    seconds = [0.40, 0.42, 0.60, 0.41]
    (line,) = describe(seconds, 11, 20, 1)
    assert line == (
        "stragglers, iterations 11-20 (compute per iteration; throughput against the median, 0.415 s): "
        "slowest rank 2 0.600 s (0.69x) | fastest rank 0 0.400 s (1.04x)"
    )
    assert describe(seconds, 11, 20, 2)[0].endswith(
        "slowest ranks 2 0.600 s (0.69x), 1 0.420 s (0.99x) | fastest ranks 0 0.400 s (1.04x), 3 0.410 s (1.01x)"
    )


def test_the_switch_turns_detection_on_and_off_over_loopback_http():
    switch = Switch(False, 0)  # port 0: any free one
    try:

        def get(path: str) -> str:
            with urllib.request.urlopen(f"http://127.0.0.1:{switch.port}{path}", timeout=10) as reply:
                return reply.read().decode()

        assert switch.server.server_address[0] == "127.0.0.1"
        assert get("/") == "straggler detection on\n" and switch.on
        assert get("/") == "straggler detection off\n" and not switch.on
        assert get("/on") == get("/on") == "straggler detection on\n"
        assert get("/off") == "straggler detection off\n" and not switch.on
        with pytest.raises(urllib.error.HTTPError) as missing:
            get("/favicon.ico")
        assert missing.value.code == 404 and not switch.on
    finally:
        switch.close()


def test_a_taken_port_is_one_line():
    first = Switch(True, 0)
    try:
        with pytest.raises(ConfigError) as err:
            Switch(True, first.port)
        assert str(err.value) == (
            f"--straggler-ctrlr-port {first.port}: cannot listen on 127.0.0.1:{first.port} "
            "(Address already in use); give a free port"
        )
    finally:
        first.close()
