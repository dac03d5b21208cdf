"""SUN / QSUN: task specialists that prefill, one shared decoder that decodes for all.

prefill.py (`PrefillWorker`), decoder.py (`SharedDecoder`), their nodes prefill_node.py and
decoder_node.py, early_kv.py (KV that overtook its assignment), client.py (`SunClient`:
the requesting side), worker_limits.py.

May import: edge.runtime and below. Not edge.star.
"""
