"""The hub's demos (`edge-hub demo`, `edge-hub demo-sun`): the only hub code that may import
export/ (training); server/hub_cli.py imports them only inside the demo commands."""
