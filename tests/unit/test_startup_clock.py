"""The start-up line: phases measured from the process's own launch."""

import subprocess
import sys
import time

from bridge_cli.logging import startup


def test_launched_at_is_this_process_start():
    # a fresh interpreter reports its own start: within its lifetime, not the machine's boot
    before = time.time()
    out = subprocess.run([sys.executable, "-c", "import time; from bridge_cli.logging.startup import launched_at, _LOADED;"
                          "print(launched_at(), _LOADED)"], capture_output=True, text=True, check=True).stdout
    launched, loaded = map(float, out.split())
    after = time.time()
    assert before - 0.05 <= launched <= loaded <= after


def test_summary_lists_phases_that_add_up():
    clock = startup.StartupClock()
    clock.lap("imports")
    time.sleep(0.2)
    clock.lap("model")
    line = clock.summary()
    assert line.startswith("start-up ") and "imports " in line and "model 0.2 s" in line
    assert abs(sum(seconds for _, seconds in clock.phases) - (clock.last - clock.started)) < 1e-6
