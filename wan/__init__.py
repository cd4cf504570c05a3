"""The WAN emulator: a TCP proxy with bandwidth, delay, jitter, traces and cuts. A program of its own
(`python -m wan`); it imports nothing of pdd."""
