"""KV export and import between engines (prefill/decode disaggregation).

    transfer.py         KVMeta, KVPayload: one request's pages and what they mean; export/import
    transfer_engine.py  KVTransferEngine: an EngineCore that exports/imports a request's K/V
    digest.py           checksums of K/V pages

May import: configs, models, engine's top level, engine/runner/, engine/sched/,
engine/sampling/. Never serving (the wire format lives in serving/disagg/).
"""
