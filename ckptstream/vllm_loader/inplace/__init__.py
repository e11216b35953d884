"""Updates applied in place inside vLLM's workers: the change between two versions in checkpoint coordinates
(``change``), and what each worker does with it (``apply``: map it onto its parameters, check, write)."""
