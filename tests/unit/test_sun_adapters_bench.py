"""benchmarks/sun/sun_adapters.py's two servers: adapters batch rows of any tasks per call; full
copies batch one task's rows per call and load a copy each time a task is not resident."""
import torch

from benchmarks.sun.sun_adapters import run_adapters, run_full_copies, zipf_trace
from edge.model.lora.adapter import init_adapter
from edge.model.lora.apply import LoraTransformer
from edge.model.transformer import ModelConfig, Transformer

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2)


def test_zipf_trace_is_skewed_and_seeded():
    t = zipf_trace(8, 2000, seed=3)
    counts = [t.count(k) for k in range(8)]
    assert t == zipf_trace(8, 2000, seed=3) and counts[0] > 3 * counts[7] and set(t) <= set(range(8))


def test_adapters_take_rows_of_any_task_and_full_copies_swap_per_task():
    torch.manual_seed(0)
    base = Transformer(CFG).eval()
    view = LoraTransformer.over(base)
    for t in range(2):
        view.add_adapter(f"t{t}", init_adapter(CFG, 4, seed=t))
    trace, prompts = [0, 1, 0, 1, 1], torch.randint(1, 64, (5, 6))
    ada = run_adapters(view, trace, prompts, batch=4)
    assert ada["calls"] == 2 and ada["loads"] == 0 and len(ada["ttft_s"]) == 5
    one = run_full_copies([base], base.state_dict(), trace, prompts, batch=4)
    assert (one["calls"], one["loads"]) == (2, 2)           # task 0's rows, then task 1's (a swap)
    two = run_full_copies([base, Transformer(CFG).eval()], base.state_dict(), [0, 1, 0, 1, 0, 1],
                          torch.randint(1, 64, (6, 6)), batch=2)
    assert (two["calls"], two["loads"]) == (4, 2)           # both resident: no swap after the first loads
    assert max(one["ttft_s"]) <= one["wall_s"]
