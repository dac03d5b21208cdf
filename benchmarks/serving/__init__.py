"""A device's OpenAI endpoint under agent workloads, against llama.cpp's own llama-server."""
