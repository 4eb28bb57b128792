"""`python -m tests.integration.pause_before_publish ITERATION ARGS...` runs `bridge ARGS...` whose save of
ITERATION, once fully written, waits 120 s before it is renamed into place, so that a test can kill -9
the run in the middle of a save. The pause wraps `bridge_cli.checkpoint.layout.publish` from outside;
everything else is the real command.
"""

from __future__ import annotations

import sys
import time


def pause_before_publishing(iteration: int) -> None:
    from bridge_cli.checkpoint import layout

    publish = layout.publish

    def paused(root, saved_iteration: int):
        if saved_iteration == iteration:
            print(f"pausing before publishing {layout.iter_name(saved_iteration)}", flush=True)
            time.sleep(120)
        return publish(root, saved_iteration)

    layout.publish = paused


if __name__ == "__main__":
    pause_before_publishing(int(sys.argv.pop(1)))
    from bridge_cli.cli.app import main

    sys.argv[0] = "bridge"
    main()
