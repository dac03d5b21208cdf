"""llama.cpp's flash attention is off by default where the model runs on the CPU alone
(edge/engines/llamacpp_load.py cpu_flash_attn: ggml-cpu computes short ubatches one query row at a time)."""
from edge.engines.llamacpp_load import cpu_flash_attn


def test_flash_attention_is_off_on_the_cpu_unless_asked():
    assert cpu_flash_attn(None, 0) is False
    assert cpu_flash_attn(True, 0) is True and cpu_flash_attn(False, 0) is False
    assert cpu_flash_attn(None, 28) is None and cpu_flash_attn(True, 28) is True     # a GPU: llama.cpp's auto
