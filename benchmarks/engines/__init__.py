"""One engine on this machine: backends x precisions, the torch engine's costs, the AMX-crash fix."""
