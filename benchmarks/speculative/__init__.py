"""Speculative decoding on one machine and against the peers: ours vs llama-cpp-python and HF, llama.cpp's own
C++ speculation vs the star, the model-free suffix draft."""
