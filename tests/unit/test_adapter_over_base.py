"""TorchAdapterBackend.over_base (edge/sun/adapter_torch.py): QSUN-LoRA's pairing, adapters over the
fp base with KV made for an int4 decoder that is another model.

* the worker's fingerprint is the int4 decoder's, its base the fp one the adapters name; the
  int4 decoder takes its KV and continues each row to the in-process split run (fp base + the
  task's adapter for the prefill, the int4 decoder for the rest);
* a decoder made from another base is refused, and no decode context is offered on the fp base.
"""
import pytest
import torch

from edge.engines.torch_engine import TorchEngine
from edge.model.lora.adapter import base_fingerprint
from edge.model.lora.apply import LoraTransformer
from edge.model.lora.files import load_adapter
from edge.model.sun_error import SunError
from edge.model.sun_modules import load_module, save_module, split_generate
from edge.sun.adapter_prefill import AdapterPrefillWorker
from edge.sun.adapter_torch import TorchAdapterBackend
from edge.sun.decoder import SharedDecoder
from export.tune import build_decoder, save_decoder
from harness.sun_adapters import trained_adapter
from harness.tiny_models import random_model

TASKS = ("maths", "tools")


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = tmp_path_factory.mktemp("over_base")
    base = random_model(4).float()
    save_module(root / "base", base, {"kind": "synthetic-base"})
    dec, fp = build_decoder(base, "int4")
    save_decoder(root / "dec", dec, "int4", fp, base_fingerprint=base_fingerprint(base))
    ads = {t: trained_adapter(base, root / "ads", t, seed=i + 1) for i, t in enumerate(TASKS)}
    return root, base, fp, ads


def test_rows_over_the_fp_base_decode_on_the_int4_decoder_as_in_process(made):
    root, base, fp, ads = made
    be = TorchAdapterBackend.over_base(root / "base", root / "dec", threads=1)
    assert be.fingerprint == fp != be.base_fp() == base_fingerprint(base)
    w = AdapterPrefillWorker(be, kv_dtype="float32", max_rows=8)
    for t in TASKS:
        w.add(t, ads[t][0], sha256=ads[t][1])
    dec_model = load_module(root / "dec")[0]
    dec = SharedDecoder(TorchEngine(dec_model, fingerprint=fp), max_batch=8)
    jobs = [("maths", [5, 9, 11, 3]), ("tools", [7, 2, 200]), ("maths", [40, 41])]
    for i, (t, p) in enumerate(jobs):
        w.submit(p, f"r{i}", task=t)
    outs = {o.request_id: o for o in w.step()}
    view = LoraTransformer.over(base)
    for t in TASKS:
        view.add_adapter(t, load_adapter(ads[t][0], base.cfg))
    for i, (t, p) in enumerate(jobs):
        o = outs[f"r{i}"]
        assert o.decoder_fingerprint == fp
        dec.admit(o.blob, f"d{i}", max_new=6, first_token=o.first_token)
        while dec.has_work():
            dec.step()
        with torch.no_grad(), view.rows(t):
            want = split_generate(view, dec_model, [p], max_new=6)[0]
        assert dec.pop_result(f"d{i}").tokens == want, (t, p)


def test_a_decoder_of_another_base_is_refused_and_no_decode_context_is_offered(made, tmp_path):
    root, base, _, _ = made
    other = random_model(9).float()
    dec, fp = build_decoder(other, "int4")
    save_decoder(tmp_path / "dec", dec, "int4", fp, base_fingerprint=base_fingerprint(other))
    with pytest.raises(SunError, match="made from another base"):
        TorchAdapterBackend.over_base(root / "base", tmp_path / "dec")
    with pytest.raises(SunError, match="not the shared decoder's weights"):
        TorchAdapterBackend.over_base(root / "base", root / "dec").decode_engine()
