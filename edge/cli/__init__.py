"""`edge-agent`: the command line (agent.py), the options it shares with `edge-hub` (options.py),
`edge-agent run`'s factory (agent_run.py, agent_config.py: the TOML config) and `plan` (plan_command.py).

May import: every package of edge/, and devices.profile (the device profiles). Nothing imports it but server/.
"""
