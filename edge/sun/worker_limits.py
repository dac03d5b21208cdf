"""What one SUN worker holds before it refuses (`overloaded`): a decoder's sequences, running and
waiting, and a prefill worker's queued prompts. Here, not in the roles, so that the CLIs show the
defaults without importing an engine."""
DEFAULT_MAX_SEQUENCES = 256      # a decoder: 4 steps' worth at the default --max-batch of 64
DEFAULT_MAX_QUEUE = 256          # a prefill worker: prompts waiting for their prefill
