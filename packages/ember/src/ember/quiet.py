"""Keep the console to what a user acts on: library import chatter is hidden unless verbose.

megatron-core warns once per module that Transformer Engine and Apex are absent (expected on
CPU and on GPU installs without them) and logs its DDP setup at INFO; torch notes the missing
CUDA runtime; transformers draws a bar for every weight load. `ember -v` (or EMBER_VERBOSE=1 in
the environment, which Ray actors inherit) shows all of it again.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

VERBOSE_ENV = "EMBER_VERBOSE"

_EXPECTED_WARNINGS = (
    r".*(Transformer Engine|Apex) .*not installed",
    r"full scope is deprecated",
)


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV) == "1"


def quiet_libraries() -> None:
    """Silence the expected warnings and INFO logs of megatron-core, torch and transformers.

    Call it before megatron-core is imported: its warnings fire at import time.
    """
    if verbose():
        return
    for message in _EXPECTED_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=UserWarning)
    logging.getLogger("megatron").setLevel(logging.WARNING)
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # read when transformers loads
    hf_logging = sys.modules.get("transformers.utils.logging")
    if hf_logging is not None:
        hf_logging.disable_progress_bar()
