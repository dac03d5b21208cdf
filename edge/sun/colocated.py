"""One device, one base: a prefill worker with adapters and the unquantised shared decoder in one process.

The base is loaded once. torch: the prefill context is `LoraTransformer.over(base)` -- the same
weight tensors (no copy) with the adapters applied per row; the decode context is a TorchEngine
over the base object itself, which no adapter ever reaches. llama.cpp: the prefill engine owns
the model and its adapters; the decoder runs on a second context of that model
(edge/sun/llamacpp_sibling.py), on which no adapter is ever set. Each context keeps its own KV. Both nodes join the star on their own links (the router sees an ordinary prefill worker
and an ordinary decoder); a job the router assigns to this decoder has its KV handed over in
memory (PrefillNode's local_decoders -> DecoderNode.take_kv): signed with the request's secret and
checked exactly as from the network, but never through the broker. A job assigned to another
decoder goes over the broker as usual.

Memory: one copy of the base's weights instead of two (plus the adapters, and each context's KV).
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

from edge.sun.adapter_prefill import AdapterPrefillWorker
from edge.sun.decoder import SharedDecoder
from edge.sun.decoder_node import DecoderNode
from edge.sun.prefill_node import PrefillNode
from edge.wire.link import Link


def colocated_nodes(backend, prefill_link: Link, decoder_link: Link, prefill_id: str, decoder_id: str,
                    adapters: Sequence[Tuple[str, str]] = (), ctl_key: Optional[bytes] = None,
                    kv_dtype: str = "float16", max_batch: int = 64, decoder_kw: Optional[dict] = None,
                    node_kw: Optional[dict] = None, grammars=None) -> Tuple[PrefillNode, DecoderNode]:
    """(prefill node, decoder node), not started, over backend's base (a TorchAdapterBackend or a
    LlamaCppAdapterBackend).
    adapters: (task, path) to load first; links: not yet connected (each node's will is set);
    grammars: the base tokenizer's (edge/sun/token_rules.py SunGrammars), which both then follow."""
    worker = AdapterPrefillWorker(backend, kv_dtype=kv_dtype, name=prefill_id, grammars=grammars)
    for task, path in adapters:
        worker.add(task, path)
    return nodes_over_worker(worker, prefill_link, decoder_link, prefill_id, decoder_id, ctl_key, max_batch,
                             decoder_kw, node_kw)


def nodes_over_worker(worker: AdapterPrefillWorker, prefill_link: Link, decoder_link: Link, prefill_id: str,
                      decoder_id: str, ctl_key: Optional[bytes] = None, max_batch: int = 64,
                      decoder_kw: Optional[dict] = None, node_kw: Optional[dict] = None
                      ) -> Tuple[PrefillNode, DecoderNode]:
    """colocated_nodes for a worker already opened (AdapterPrefillWorker.open: `edge-agent run --role
    prefill --with-decoder`): the decoder runs on its backend's base and follows its grammars."""
    from edge.wire.protocol import sun_hello_topic
    backend, grammars = worker.backend, worker.grammars
    engine = backend.decode_engine(max_batch)     # the decode context on the same weights
    decoder = SharedDecoder(engine, max_batch=max_batch, name=decoder_id, grammars=grammars, **dict(decoder_kw or {}))
    dec_node = DecoderNode(decoder, decoder_link, decoder_id, ctl_key)
    pre_node = PrefillNode(worker, prefill_link, prefill_id, ctl_key, local_decoders={decoder_id: dec_node},
                           **dict(node_kw or {}))
    decoder_link.set_will(sun_hello_topic(decoder_id), dec_node.will())
    prefill_link.set_will(sun_hello_topic(prefill_id), pre_node.will())
    return pre_node, dec_node


def shares_weights(backend, decoder_node: DecoderNode) -> bool:
    """Whether the prefill context and the decoder read the same weight storage (no second copy)."""
    dec = dict(decoder_node.decoder.engine.model.named_parameters())
    view = dict(backend.view.named_parameters())
    return bool(dec) and all(name in view and view[name].data_ptr() == p.data_ptr() for name, p in dec.items())
