"""/v1/models names the served model, never the device's path to its file (issue 35, point 6)."""
import json
import urllib.request

from edge.api.openai_http import OpenAIServer, served_model_id


def test_served_model_id_is_a_name_not_a_path():
    assert served_model_id("/home/nv/starsun/artifacts/SmolLM2-135M-Instruct.Q4_1.gguf") == \
        "SmolLM2-135M-Instruct.Q4_1"
    assert served_model_id("qwen2.5-coder-1.5b") == "qwen2.5-coder-1.5b"      # a fetch name keeps its dots
    assert served_model_id("/r/artifacts/qsun-bundle/") == "qsun-bundle"
    assert served_model_id("/r/out/model.onnx") == "model"


def test_v1_models_shows_the_name():
    server = OpenAIServer(lambda *a, **k: None, None, model_name="/home/nv/starsun/artifacts/qwen.Q4_K_M.gguf",
                          port=0).start()
    try:
        got = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{server.port}/v1/models", timeout=10).read())
    finally:
        server.stop()
    assert [m["id"] for m in got["data"]] == ["qwen.Q4_K_M"]
