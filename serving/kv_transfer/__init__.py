"""Prefill/decode disaggregation (docs/architecture.md, "Prefill/decode disaggregation"):
`--kv-transfer-config` and our connector on `jax.experimental.transfer`, speaking vLLM's
`kv_transfer_params` handshake so vLLM's P/D proxies (vllm-router, llm-d's sidecar) can drive
a prefill and a decode instance.

    config.py        --kv-transfer-config, vLLM's keys, checked (no JAX)
    params.py        the kv_transfer_params a request brings and a prefill answers (no JAX)
    side_channel.py  the producer's claim/release line protocol over TCP (no JAX)
    pages.py         a request's KV pages gathered into arrays and scattered back (JAX)
    connector.py     JaxTransferConnector: offers (producer), pulls (consumer)
"""
