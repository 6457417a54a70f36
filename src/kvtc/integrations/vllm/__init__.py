"""vLLM integration: the `KVTCConnector` V1 KV connector and its paged-layout adapters.

Load it with ``--kv-transfer-config '{"kv_connector": "KVTCConnector", "kv_connector_module_path":
"kvtc.integrations.vllm.connector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
"kv_connector_extra_config": {...}}'`` or through the ``vllm.general_plugins`` entry point
(:func:`register`). Importing this package does not import vLLM; :mod:`.paged`, :mod:`.config` and :mod:`.codecs`
need only torch (the startup checks of a configuration can run without an engine).

Modules: :mod:`.connector` (the facade vLLM loads), :mod:`.scheduler` and :mod:`.worker` (its two sides),
:mod:`.helper` (the worker's codec process), :mod:`.chunks` (one chunk to a blob and back), :mod:`.groups` (vLLM's
KV-cache groups), :mod:`.config` (configuration and its validation), :mod:`.codecs`, :mod:`.metadata`,
:mod:`.paged`.
"""

from __future__ import annotations

CONNECTOR_NAME = "KVTCConnector"
CONNECTOR_MODULE = "kvtc.integrations.vllm.connector"
#: where the connector's settings come from (vLLM's ``kv_transfer_config`` key), named in every refusal of one
WHERE = "kv_connector_extra_config"


def register() -> None:
    """``vllm.general_plugins`` entry point: make ``"kv_connector": "KVTCConnector"`` resolvable by name."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)
    except ValueError:
        pass  # plugins load once per process, but more than one process may share an interpreter


__all__ = ["CONNECTOR_MODULE", "CONNECTOR_NAME", "WHERE", "register"]
