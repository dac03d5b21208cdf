"""`edge-agent`'s commands and the command-line pieces `edge-hub` shares with it.

agent.py (`edge-agent`: generate, demo), agent_run.py (`run`: its AgentConfig and the factory that
starts a role), agent_roles.py (each role's loop; role_endpoint.py: what a target and a drafting
device share), agent_config.py (`run --config`, a flat TOML),
plan_command.py (`plan`: will a role fit a device), and what both CLIs share: options.py (every
shared option, declared once, and the readers of their values; broker_options.py: the broker's and
its credentials'), sections.py (options grouped into
--help sections), config_file.py (`--config` files, flat or one table per section), startup.py
(opening a model, building a draft of any kind, telemetry, signals), placing.py (a model's
placement as a command decides and shows it: the start line).

May import: every package of edge/, and devices.profile (the device profiles). Nothing imports it but server/.
"""
