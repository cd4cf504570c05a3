"""Where a request goes: live instances (heartbeats, pings), the MD cache index, measured costs, the
pipeline policy, and the dispatcher that assigns the chosen instances."""
