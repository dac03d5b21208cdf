"""The placement reaches the runtimes: the n_gpu_layers llama.cpp's model params get, the
onnxruntime session's providers, the torch device of the weights and KV -- read back from the
real engines on this CPU machine -- and an absent GPU is a command error naming the fix."""
import click
import pytest
import torch

from edge.cli.placing import place_model
from edge.cli.startup import open_model_for_command
from edge.engines.placement import Capabilities, decide_placement
from edge.model.resolved import resolve

CUDA_LLAMA = Capabilities(llama_gpu_offload=True)


def test_llamacpp_model_params_get_the_placements_layers(exports):
    from edge.engines.llamacpp_engine import LlamaCppEngine
    gguf = exports.gguf("llama")
    for caps, want in ((Capabilities(llama_gpu_offload=False), 0), (CUDA_LLAMA, -1)):
        p = decide_placement("llamacpp", "auto", None, None, caps)
        eng = LlamaCppEngine(gguf, max_len=64, n_seq_max=1, **p.engine_kwargs())
        assert eng.model_params.n_gpu_layers == want        # what llama_model_load_from_file was given
        assert eng.gpu_layers == 0                          # this build offloads nothing, and says so
        assert eng.where().startswith(f"all {eng.cfg.num_layers} layers on the CPU (n_gpu_layers={want}); "
                                      "weight repacking on (auto: ")   # F32: llama.cpp's default kept
        eng.close()


def test_the_command_path_places_llamacpp_on_the_cpu_here(exports, capsys):
    eng, _ = open_model_for_command(resolve(exports.gguf("llama"), "llamacpp"), "float32", None, 64,
                                    gpu_layers="0", n_seq_max=1)
    assert eng.model_params.n_gpu_layers == 0
    err = capsys.readouterr().err
    assert "placement: llamacpp on cpu: all layers on the CPU (asked for --gpu-layers 0)" in err
    assert "layers on the CPU (n_gpu_layers=0)" in err
    eng.close()


def test_onnx_session_gets_the_placements_providers(exports):
    from edge.engines.onnx_engine import OnnxEngine
    p = place_model(resolve(exports.onnx("llama")), "auto")
    assert p.backend == "onnx" and p.ort_providers == ("CPUExecutionProvider",)
    eng = OnnxEngine(exports.onnx("llama"), **p.engine_kwargs())
    assert eng.session.get_providers() == ["CPUExecutionProvider"]
    assert eng.where() == "onnxruntime providers CPUExecutionProvider"


def test_torch_weights_and_kv_on_the_placements_device(exports):
    from edge.engines.torch_engine import TorchEngine
    p = decide_placement("torch", "auto", None, None, None)   # probes this machine's torch: no CUDA
    eng = TorchEngine(exports.model("llama"), fingerprint="t", **p.engine_kwargs())
    s = eng.new_sequence()
    eng.forward(s, [1, 2, 3])
    assert {q.device.type for q in eng.model.parameters()} == {"cpu"}
    assert eng._seqs[s].data.device.type == "cpu"
    assert eng.where().startswith("torch device cpu")


@pytest.mark.parametrize("backend,fix", [("llamacpp", "-DGGML_CUDA=ON"), ("onnx", "onnxruntime-gpu"),
                                         ("torch", "JetPack's torch")])
def test_cuda_here_is_a_command_error_with_the_fix(exports, backend, fix):
    model = {"llamacpp": exports.gguf("llama"), "onnx": exports.onnx("llama")}.get(backend, exports.gguf("llama"))
    with pytest.raises(click.ClickException) as e:
        place_model(resolve(model, backend, "target"), "cuda", None)
    assert fix in e.value.message and "--accelerator cpu" in e.value.message


def test_gpu_layers_all_here_is_refused_before_loading(exports):
    with pytest.raises(click.ClickException, match="CPU-only"):
        open_model_for_command(resolve(exports.gguf("llama"), "llamacpp"), "float32", None, 64, gpu_layers="all")


def test_a_jetson_profile_with_this_cpu_llama_cpp_warns(exports, capsys):
    p = place_model(resolve(exports.gguf("llama"), "auto", "target"), "auto", None, profile="jetson-orin-nano-8gb")
    assert p.device == "cpu"
    assert "warning: profile jetson-orin-nano-8gb is a Jetson" in capsys.readouterr().err


def test_torch_device_from_the_loader(tmp_path):
    """load_engine's device reaches TorchEngine (auto stays on the CPU: placement decides first)."""
    from edge.engines.loader import load_engine
    from edge.model.sun_modules import save_module
    from edge.model.transformer import Transformer, tiny_config
    d = save_module(tmp_path / "m", Transformer(tiny_config("llama")), {"fingerprint": "tiny"})
    for device in ("auto", "cpu"):
        eng = load_engine(d, backend="torch", dtype="bfloat16", device=device)
        assert eng.device == torch.device("cpu") and eng.dtype == torch.bfloat16
        assert next(eng.model.parameters()).device == eng.device


def test_sun_decoder_takes_the_placements_engine_arguments(tmp_path):
    """The hub's and the agent's SUN decoder load on the placement's device (SharedDecoder.from_dir)."""
    from edge.model.sun_modules import weights_fingerprint
    from edge.sun.decoder import SharedDecoder
    from export.tune import save_decoder
    from harness.tiny_models import tiny_model
    m = tiny_model()
    d = save_decoder(tmp_path / "decoder", m, "fp32", weights_fingerprint(m))
    p = decide_placement("torch", "cpu", None, None, None)
    dec = SharedDecoder.from_dir(d, engine_kw=p.engine_kwargs())
    assert dec.engine.device == torch.device("cpu")
    assert next(dec.engine.model.parameters()).device.type == "cpu"
