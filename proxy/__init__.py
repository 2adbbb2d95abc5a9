"""The serving side of BalanceRoute: an OpenAI-compatible routing proxy, an engine emulator for
tests and capacity planning, and a load generator (the paper's serving proxy).

Built on :mod:`router_client` (``RouterClient`` holds the fleet state); it talks to the
prediction service only over HTTP and never imports ``predictor`` or ``models``.
"""

POLICIES = ("br0", "brh", "jsq", "rr", "ltl")  # what ``balanceroute proxy --policy`` takes
BR_POLICIES = ("br0", "brh")  # those that route by BR (BalanceRouteParams); the rest: baselines
LENGTHS_FROM = ("service", "max-tokens")  # where ``--policy brh`` takes its predictions from
