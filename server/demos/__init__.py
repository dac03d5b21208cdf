"""The hub's demos (`edge-hub demo`, `edge-hub demo-sun`): the only hub code that may import
export/ (training); server/cli.py imports them only inside the demo commands."""
