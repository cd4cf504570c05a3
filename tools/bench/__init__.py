"""`pdd bench`: replay workloads against a pdd stack in each deployment mode and report the results.

`config` (what a run is), `modes` (mode -> stack and request fields), `workloads` (what to send),
`replay` (sending it), `metrics` (what it measured), `runner` (stacks x workloads), `report` and
`plots` (writing it down), `cli` (the `pdd bench` command).
"""
