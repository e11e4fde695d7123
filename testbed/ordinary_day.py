"""The emulated ordinary day's plan, one place for the integration test and `bench/ordinary_day.py`.

Each ordinary-day scenario runs as its own cluster with its own rate and length of load;
the sidecar watching them runs the settings below (the incident tests' floors, a 1 s
heartbeat, a 10 s flow window so that the idle spell outlasts every window it has).
"""

from __future__ import annotations

from typing import Any

RESTART_AT = 8.0  # seconds into the load when each scenario's steps begin
IDLE_S = 130.0  # 13 flow windows, longer than the rules' longest range (2 m)
OVERLOAD_S = 90.0
HEARTBEAT_S = 1.0
FLOOR_TRANSFER_S = 4.0
FLOOR_DECODE_S = 3.0
FLOW_WINDOW_S = 10.0

# scenario -> (requests/s, seconds of load, Params overrides)
PLAN: dict[str, tuple[float, float, dict[str, Any]]] = {
    "scale-down": (2.0, 40.0, {}),
    "scale-up": (2.0, 40.0, {}),
    "rolling-restart": (2.0, 50.0, {}),
    "kill-idle": (1.0, 40.0, {}),
    "overload": (0.5, RESTART_AT + OVERLOAD_S + 30.0, {"overload_s": OVERLOAD_S}),
    "idle": (2.0, RESTART_AT + IDLE_S + 20.0, {"idle_s": IDLE_S}),
}
