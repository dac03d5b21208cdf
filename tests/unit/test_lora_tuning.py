"""Prefill-only LoRA tuning (export/tune.py with adapter="lora", export/tune_lora.py).

A few steps on a tiny model lower the split loss and change nothing but the adapter (base and
decoder weights bit-equal before and after); the output directory is PEFT's adapter files plus
a manifest, and loading it back over the base reproduces the tuned prefill exactly; a resumed
run equals the uninterrupted one, and a resume with other LoRA options is refused.
"""
import json

import pytest
import torch

from edge.model.lora.adapter import base_fingerprint
from edge.model.lora.apply import LoraTransformer, lora_prefill
from edge.model.lora.files import CONFIG_FILE, WEIGHTS_FILE, adapter_sha256, load_adapter
from edge.model.sun_modules import pad_right
from edge.model.transformer import Transformer, tiny_config
from export.tasks import SYNTHETIC, VOCAB, split
from export.tune import TuneConfig, TuneError, build_decoder, split_loss, tune


def tiny(seed=0):
    torch.manual_seed(seed)
    return Transformer(tiny_config(vocab_size=VOCAB, num_layers=2, max_position=64))


def snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def unchanged(model, before):
    return all(torch.equal(before[k], v) for k, v in model.state_dict().items())


LORA = dict(adapter="lora", rank=4, alpha=8.0, batch_size=8, lr=1e-2, warmup=2, max_new=6)


@pytest.mark.parametrize("precision", ("fp32", "int4"))
def test_lora_tuning_lowers_the_loss_and_changes_only_the_adapter(tmp_path, precision):
    base = tiny(1)
    tr, ev = split(SYNTHETIC["reverse"], 400, 16, seed=2)
    dec, fp = build_decoder(base, precision)
    base_before, dec_before = snapshot(base), snapshot(dec)
    cfg = TuneConfig(steps=12, decoder=precision, targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                           "up_proj", "down_proj"), **LORA)
    res = tune(base, tr, cfg, out_dir=tmp_path / "rev", decoder=(dec, fp), progress=False,
               manifest_extra={"task": "reverse", "base": "tiny"})
    trainee = res.prefill
    with torch.no_grad():
        after = float(split_loss(trainee, dec, ev))
        with trainee.view.rows(None):                       # the same view, adapter off: the base
            start = float(split_loss(trainee.view, dec, ev))
    assert after < 0.8 * start, (start, after)
    assert unchanged(base, base_before) and unchanged(dec, dec_before)
    assert res.decoder is dec and res.decoder_fingerprint == fp
    # only the adapter trained: A and B are the trainee's only parameters, and B left zero
    assert [p.shape for p in trainee.parameters()] == [p.shape for p in trainee.adapter.parameters()]
    assert all(float(b.abs().max()) > 0 for b in trainee.adapter.lora_b.values())
    # the directory: PEFT's files + a manifest, megabytes not a model
    d = tmp_path / "rev"
    assert {p.name for p in d.iterdir()} == {CONFIG_FILE, WEIGHTS_FILE, "manifest.json"}
    man = json.loads((d / "manifest.json").read_text())
    assert man["kind"] == ("qsun-lora" if precision == "int4" else "sun-lora")
    assert man["decoder_fingerprint"] == fp and man["base_fingerprint"] == base_fingerprint(base)
    assert man["adapter"]["sha256"] == adapter_sha256(d) and man["task"] == "reverse"
    assert (d / WEIGHTS_FILE).stat().st_size < 0.25 * sum(v.numel() * 4 for v in base.state_dict().values())
    # loaded back over the base it gives exactly the tuned prefill
    view = LoraTransformer.over(base)
    view.add_adapter("reverse", load_adapter(d, base.cfg, sha256=man["adapter"]["sha256"],
                                             base_fingerprint=base_fingerprint(base)))
    toks, lens = pad_right([e.prompt for e in ev[:4]])
    with torch.no_grad():
        want = lora_prefill(trainee.view, toks, lens, trainee.TASK)[0]
        assert torch.equal(lora_prefill(view, toks, lens, "reverse")[0], want)


def test_resume_gives_the_uninterrupted_run(tmp_path):
    base = tiny(3)
    tr, _ = split(SYNTHETIC["sort"], 300, 8, seed=4)
    cfg = TuneConfig(steps=6, ckpt_every=3, seed=5, targets=("q_proj", "v_proj", "down_proj"), **LORA)
    whole = tune(base, tr, cfg, progress=False).prefill
    tune(base, tr, cfg, out_dir=tmp_path / "run", progress=False)
    # the run checkpointed at step 3; drop the final adapter and resume from there
    (tmp_path / "run" / WEIGHTS_FILE).unlink()
    assert json.loads((tmp_path / "run" / "checkpoint" / "state.json").read_text())["step"] == 3
    resumed = tune(base, tr, cfg, out_dir=tmp_path / "run", progress=False).prefill
    for (n, a), b in zip(whole.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), n
    saved = load_adapter(tmp_path / "run", base.cfg)
    assert all(torch.equal(x, y) for x, y in zip(saved.parameters(), whole.adapter.parameters()))
    with pytest.raises(TuneError, match="rank=4.*now rank=8"):
        tune(base, tr, TuneConfig(**{**cfg.__dict__, "rank": 8}), out_dir=tmp_path / "run", progress=False)


def test_lora_options_are_checked():
    with pytest.raises(TuneError, match="adapter applies to SUN"):
        TuneConfig(mode="full", adapter="lora")
    with pytest.raises(TuneError, match="rank must be a positive integer"):
        TuneConfig(adapter="lora", rank=0)
    from edge.model.lora.error import AdapterError
    with pytest.raises(AdapterError, match="unknown target module 'wq'"):
        TuneConfig(adapter="lora", targets=("q", "wq"))
    assert TuneConfig(adapter="lora", targets=("down", "q")).targets == ("q_proj", "down_proj")


def test_the_cli_tunes_an_adapter_and_re_tunes_it_for_the_int4_decoder(tmp_path):
    from click.testing import CliRunner

    from export.tune_cli import tune as tune_cmd
    from harness.tiny_hf import hf_dir
    base_dir, base = hf_dir(tmp_path / "base")
    data = tmp_path / "pairs.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"say {i}", "answer": f"{i} {i}"}) for i in range(24)))
    common = ["--base", str(base_dir), "--data", str(data), "--steps", "2", "--batch-size", "4",
              "--n-eval", "2", "--eval-every", "0", "--ckpt-every", "0", "--adapter", "lora", "--rank", "4"]
    run = CliRunner().invoke(tune_cmd, common + ["--targets", "q,v,down", "--out", str(tmp_path / "fp")])
    assert run.exit_code == 0, run.output
    ad = load_adapter(tmp_path / "fp", base.cfg, base_fingerprint=base_fingerprint(base))
    assert (ad.rank, ad.alpha, ad.targets) == (4, 8.0, ("q_proj", "v_proj", "down_proj"))
    run = CliRunner().invoke(tune_cmd, common + ["--targets", "q,v,down", "--decoder", "int4",
                                                 "--init", str(tmp_path / "fp"), "--out", str(tmp_path / "q4")])
    assert run.exit_code == 0, run.output
    man = json.loads((tmp_path / "q4" / "manifest.json").read_text())
    from edge.model.checkpoint import load_model
    loaded = load_model(base_dir)[0]             # as the CLI loads it (its config carries the loader's extras)
    assert man["kind"] == "qsun-lora" and man["decoder_fingerprint"] == build_decoder(loaded, "int4")[1]
    assert man["base_fingerprint"] == base_fingerprint(base) == base_fingerprint(loaded)
    # an adapter --init with other LoRA options, and bad targets, are refused with what to do
    run = CliRunner().invoke(tune_cmd, common + ["--init", str(tmp_path / "fp"), "--out", str(tmp_path / "x")])
    assert run.exit_code != 0 and "tune with the same --rank and --targets" in run.output
    run = CliRunner().invoke(tune_cmd, common + ["--targets", "q,wq", "--out", str(tmp_path / "y")])
    assert run.exit_code == 2 and "unknown target module 'wq'" in run.output
